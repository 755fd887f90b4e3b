"""A model's next call is sent to its node while the call before it runs (#64): a step's optim_step reaches the agent
during its forward_backward, carrying that call's id (SessionRequest.after), and the agent runs it only once that
call ran there; a call sent after one that never ran there is answered retry, not run, and the gateway then sends it
in its turn. The steps stay exactly once and in order. On the real stack (nats-server, scheduler, an agent as a
process with the real session trainer), the official client driving the gateway."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from schemas import names
from schemas.sessions import CallError, ForwardResult, OptimStep, SessionReply, SessionRequest, StepResult
from schemas.tinker_store import ModelRecord, model_key
from services import bus
from tests.test_session_pause import FB
from tests.test_tinker_api import client, datums, gateway, key_for  # noqa: F401  (gateway: a fixture)

pytestmark = pytest.mark.timeout(600)
os.environ.setdefault("TINKER_TELEMETRY", "0")
STEPS = 6
_request = msgspec.json.Decoder(SessionRequest)


def steps(gw, key: str) -> tuple[str, list[float]]:
    """STEPS steps of forward_backward then optim_step, each sent before the first's result is asked for (as a
    training loop sends them); the model id and each step's optimizer_step metric."""
    from tinker import types

    tc = client(gw, key).create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False)
    batch, _ = datums(tc.get_tokenizer(), types)
    counted = []
    for _ in range(STEPS):
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result()
        counted.append(opt.result().metrics["optimizer_step:unique"])
    return tc.model_id, counted


async def test_a_steps_optim_step_is_sent_during_its_forward_backward_and_runs_once_after_it(nc, gateway):  # noqa: F811
    seen: list[SessionRequest] = []

    async def watch(msg) -> None:
        seen.append(_request.decode(msg.data))

    sub = await nc.subscribe(names.node("box").session, cb=watch)  # beside the agent's: every call sent to the node
    key = await key_for(nc, "acme")
    model_id, counted = await asyncio.to_thread(steps, gateway, key)
    await sub.unsubscribe()
    assert counted == [float(n) for n in range(1, STEPS + 1)], counted  # each step once, in order
    optims = [r for r in seen if isinstance(r.call, OptimStep)]
    ahead = [r for r in optims if r.after]
    for r in ahead:  # each after its own step's forward_backward (seq_id one before its own)
        seq = int(r.call_id.rsplit(":", 1)[1])
        assert r.after == f"{model_id}:{seq - 1}", (r.call_id, r.after)
    assert ahead, f"no optim_step of {len(optims)} was sent during its forward_backward"


async def test_a_call_sent_after_one_that_did_not_run_there_is_answered_retry_and_not_run(nc, gateway):  # noqa: F811
    key = await key_for(nc, "acme")
    model_id, _ = await asyncio.to_thread(steps, gateway, key)
    found = await (await nc.jetstream().key_value(names.TINKER_KV)).get(model_key("acme", model_id))
    job = msgspec.json.decode(found.value, type=ModelRecord).job
    subject = names.node("box").session

    async def ask(call, call_id: str, after: str = "") -> SessionReply:
        request = SessionRequest(job=job, tenant="acme", call=call, call_id=call_id, after=after)
        return await bus.request(nc, subject, request, SessionReply, 60)

    refused = await ask(OptimStep(learning_rate=1e-3), "t-opt-1", after="t-never-sent")
    assert isinstance(refused, CallError) and refused.retry, refused
    # both at once, the step after the forward_backward: it runs once that one has run, and steps once
    fb, opt = await asyncio.gather(ask(FB, "t-fb"), ask(OptimStep(learning_rate=1e-3), "t-opt-2", after="t-fb"))
    assert isinstance(fb, ForwardResult), fb
    assert isinstance(opt, StepResult) and opt.step == STEPS + 1, opt  # the refused one never ran: one step, not two
    again = await ask(OptimStep(learning_rate=1e-3), "t-opt-1")  # the refused call in its turn: it runs now
    assert isinstance(again, StepResult) and again.step == STEPS + 2, again
