"""Review of 350e119, 890ae0f, 774eee4 and ebc2254 (#63): a Tinker session's client is told "your calls were lost,
load_state" exactly when calls that changed the session were lost. A loss told falsely makes the client throw
away the steps a pause kept; one kept silent lets it train on from a state it never saw. Real stack: nats-server,
the scheduler, an agent as a process with the real session trainer, a gateway, the official client."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import msgspec
import pytest

from schemas import names
from schemas.tinker_store import FutureRecord, gateway_key, token
from tests.conftest import wait_for, wait_nodes
from tests.test_review2_session_attempts import (
    Steps,
    _checkpointed,
    _gateway,
    _paused_and_resumed_elsewhere,
    _record,
    _state,
    a_session,
    saved_then_stepped,
)
from tests.test_review4_session_attempts import _a_call_ahead
from tests.test_tinker_api import key_for
from tests.test_tinker_store import RoundRobin, gateway_process, listening

pytestmark = pytest.mark.timeout(900)
os.environ.setdefault("TINKER_TELEMETRY", "0")
BOX = dict(gpus=None, offer_cpu=True, trainer=None, interval=0.25)


async def test_a_call_refused_on_a_resumed_attempt_then_its_node_lost_is_no_loss(nc, stack, tiny_model, agents):
    """The session paused and resumed (attempt 2, from the pause's checkpoint at step 2). The client's next
    forward_backward is refused by the session (a token outside the vocabulary: a 400, nothing changed), then the
    node dies before any other call. Attempt 3 goes on from the pause's checkpoint with every step kept: the next
    step is step 3, untold (890ae0f: an answer that refused the call made attempt 2 the one trained on, and its
    loss was told: 'load_state it', which throws away step 2)."""
    async with a_session(nc, tiny_model, agents) as held:
        steps = held.steps
        job = await saved_then_stepped(nc, steps)
        await _paused_and_resumed_elsewhere(nc, job)

        def refused() -> None:
            bad = steps.types.Datum(
                model_input=steps.types.ModelInput.from_ints([1, 2, 10**6]),
                loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
            )
            steps.tc.forward_backward([bad], "cross_entropy").result()

        with pytest.raises(Exception, match="outside the vocabulary"):  # answered by attempt 2, which changed nothing
            await asyncio.to_thread(refused)
        agents.kill("box")
        agents.start("box", **BOX)
        await wait_for(lambda: _state(nc, job, "running", 3), timeout=120, what="attempt 3 running")
        assert await asyncio.to_thread(steps.step) == 3.0  # found: 'went away ... load_state it'


async def test_a_loss_told_by_a_gateway_killed_before_it_wrote_the_record_again_is_not_told_twice(
    nc, stack, tiny_model, agents, nats_server, tmp_path
):
    """Step 1 saved, step 2 lost with the node (attempt 2 from the save). The gateway that runs the model's calls (a
    process) tells the next forward_backward the loss and stores that answer; a call sent far ahead keeps it from
    idling (when it would write its record of the model), and it is killed (SIGKILL). The next gateway takes the
    model over: the client heard of the loss and goes on from its save, so its next step is step 2, untold
    (890ae0f: the record still named attempt 1 as trained on, and the loss was told a second time)."""
    agents.start("box", **BOX)
    await wait_nodes(nc, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    doomed = gateway_process(nats_server.url, port, tiny_model, open(tmp_path / "doomed.log", "ab"))
    survivor = _gateway(nc, tiny_model)
    await survivor.start()
    front = RoundRobin([port])
    try:
        await wait_for(lambda: listening(port), timeout=60, what="the first gateway listening")
        steps = await asyncio.to_thread(Steps, await front.start(), key := await key_for(nc, "acme"))
        model = steps.tc.model_id
        assert await asyncio.to_thread(steps.step) == 1.0
        await asyncio.to_thread(lambda: steps.tc.save_state("kept").result())
        job = (await _record(nc, model)).job
        await wait_for(lambda: _checkpointed(nc, job), timeout=60, what="the save stored as the job's checkpoint")
        assert await asyncio.to_thread(steps.step) == 2.0  # lost with the node
        agents.kill("box")
        agents.start("box", **BOX)
        await wait_for(lambda: _state(nc, job, "running", 2), timeout=120, what="attempt 2 running from the save")
        record = await _record(nc, model)
        told = record.next_seq
        await _a_call_ahead(nc, port, key, model)
        with pytest.raises(Exception, match="went away"):
            await asyncio.to_thread(lambda: steps.tc.forward_backward(steps.batch, "cross_entropy").result())
        await wait_for(lambda: _outcome_stored(nc, model, told), timeout=60, what="the told answer stored")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        kv = await nc.jetstream().key_value(names.TINKER_KV)
        await kv.delete(gateway_key(record.pump))  # gone, as LIVE_S after its last beat
        front.ports[0] = survivor.port
        assert await asyncio.to_thread(steps.step) == 2.0  # found: 'went away' a second time
    finally:
        await front.close()
        await survivor.close()
        if doomed.poll() is None:
            doomed.kill()


async def _outcome_stored(nc, model: str, seq: int) -> bool:
    futures = await nc.jetstream().key_value(names.TINKER_FUTURES_KV)
    found = await futures.get(f"call.acme.{token(model)}.{seq}")
    return msgspec.json.decode(found.value, type=FutureRecord).outcome is not None
