"""Review of 10c94aa (#63): a session's calls name the attempt they went to, and the gateway tells its client a loss
only when the attempt they went to did not end in a pause (JobSummary.paused_attempts). A pause is not a loss:
its checkpoint holds every call answered before it. Here the session is paused and resumed by someone other than
the gateway that runs its calls (a user's `jetlora pause` and `resume`, as the scheduler resumes a session paused
for a serving engine), while the client is between calls: the gateway never saw it paused, so only paused_attempts
tells it this new attempt is no move. The client's next step must go on as the step after its last, with no
notice, whether the same gateway runs its calls or one started since (a gateway restarted, or another taking the
model over, knows only what the model's record says). Real stack: nats-server, the scheduler, an agent as a
process with the real session trainer, the official client; alone and in a session group."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator

import msgspec
import pytest

from schemas import names
from schemas.jobs import Error
from schemas.job_status import JobQuery, JobReply
from schemas.tinker_store import ModelRecord, gateway_key, model_key
from services import bus
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.outcomes import STEP_METRIC
from services.gateway.tinker.settings import TinkerSettings
from tests.conftest import STACK_CONFIG, get_job, start_stack, wait_for, wait_nodes
from tests.test_tinker_api import client, datums, key_for
from tests.test_tinker_store import RoundRobin

pytestmark = pytest.mark.timeout(600)
os.environ.setdefault("TINKER_TELEMETRY", "0")
SETTINGS = TinkerSettings(silence_s=600)  # the client's heartbeats may lapse on a busy machine: not this test's


class Steps:
    """A training client in a thread of its own (the tinker client blocks): each step's optimizer_step metric."""

    def __init__(self, port: int, key: str) -> None:
        from tinker import types

        self.types, self.sc = types, client(_Port(port), key)
        self.tc = self.sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        self.batch, _ = datums(self.tc.get_tokenizer(), types)

    def step(self) -> float:
        self.tc.forward_backward(self.batch, "cross_entropy").result()
        metrics = self.tc.optim_step(self.types.AdamParams(learning_rate=1e-2)).result().metrics
        return metrics[STEP_METRIC]


@dataclasses.dataclass
class _Port:
    port: int


def _gateway(nc, tiny_model, port: int = 0) -> Gateway:
    models = {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}
    return Gateway(nc, models, port=port, tinker_settings=SETTINGS)


@dataclasses.dataclass
class Held:
    """A training client of acme's and the gateway it goes through (a test may close it and start another)."""

    steps: Steps
    gw: Gateway


@contextlib.asynccontextmanager
async def a_session(nc, tiny_model, agents) -> AsyncIterator[Held]:
    """Node box (one CPU device), a gateway, and a training client through it; the client closed after."""
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    held = Held(None, _gateway(nc, tiny_model))  # type: ignore[arg-type]
    await held.gw.start()
    try:
        held.steps = await asyncio.to_thread(Steps, held.gw.port, await key_for(nc, "acme"))
        yield held
        await asyncio.to_thread(held.steps.sc.close, "success")
    finally:
        await held.gw.close()


@dataclasses.dataclass
class Balanced:
    """A training client behind a balancer in front of two gateways, step 1 saved as "kept" through the first."""

    steps: Steps
    gateways: list[Gateway]
    front: RoundRobin
    model: str
    job: str
    first: str  # the gateway that runs the model's calls


@contextlib.asynccontextmanager
async def behind_a_balancer(nc, tiny_model, agents) -> AsyncIterator[Balanced]:
    """Node box (one CPU device), two gateways and a balancer that sends the client to the first (a test moves it
    with front.ports[0]); the client closed after."""
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gateways = [_gateway(nc, tiny_model), _gateway(nc, tiny_model)]
    for gw in gateways:
        await gw.start()
    front = RoundRobin([gateways[0].port])
    try:
        steps = await asyncio.to_thread(Steps, await front.start(), await key_for(nc, "acme"))
        model = steps.tc.model_id
        assert await asyncio.to_thread(steps.step) == 1.0
        await asyncio.to_thread(lambda: steps.tc.save_state("kept").result())
        job = (await _record(nc, model)).job
        await wait_for(lambda: _checkpointed(nc, job), timeout=60, what="the save stored as the job's checkpoint")
        yield Balanced(steps, gateways, front, model, job, (await _record(nc, model)).pump)
        await asyncio.to_thread(steps.sc.close, "success")
    finally:
        await front.close()
        for gw in gateways:
            await gw.close()


async def saved_then_stepped(nc, steps: Steps) -> str:
    """Step 1, saved as "kept", then step 2 (which only a pause keeps): the session's job."""
    assert await asyncio.to_thread(steps.step) == 1.0
    await asyncio.to_thread(lambda: steps.tc.save_state("kept").result())
    assert await asyncio.to_thread(steps.step) == 2.0
    return (await _record(nc, steps.tc.model_id)).job


async def _record(nc, model_id: str) -> ModelRecord:
    found = await (await nc.jetstream().key_value(names.TINKER_KV)).get(model_key("acme", model_id))
    return msgspec.json.decode(found.value, type=ModelRecord)


async def _state(nc, job: str, state: str, attempt: int):
    j = await get_job(nc, job)
    return j if j.state == state and j.attempt == attempt else None


async def _paused_and_resumed_elsewhere(nc, job: str) -> None:
    """Paused and resumed through the jobs API, not by the gateway: a new attempt from the pause's checkpoint."""
    api = names.jobs_api("acme")
    assert isinstance(await bus.request(nc, api.pause, JobQuery(job), JobReply | Error), JobReply)
    await wait_for(lambda: _state(nc, job, "paused", 1), timeout=120, what="the session paused, its state saved")
    assert isinstance(await bus.request(nc, api.resume, JobQuery(job), JobReply | Error), JobReply)
    await wait_for(lambda: _state(nc, job, "running", 2), timeout=120, what="attempt 2 running")


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "in a session group"])
@pytest.mark.parametrize("restarted", [False, True], ids=["same gateway", "gateway restarted"])
async def test_a_pause_its_gateway_did_not_see_is_not_told_as_a_loss(
    nc, services, tiny_model, agents, grouped, restarted
):
    await start_stack(services, dataclasses.replace(STACK_CONFIG, co_train="same-tenant" if grouped else "off"))
    async with a_session(nc, tiny_model, agents) as held:
        steps = held.steps
        assert [await asyncio.to_thread(steps.step) for _ in range(2)] == [1.0, 2.0]
        model = steps.tc.model_id
        await wait_for(lambda: _attempt_recorded(nc, model), timeout=60, what="the model's record at attempt 1")
        job = (await _record(nc, model)).job
        if restarted:  # what the next gateway knows of the model is its record
            port = held.gw.port
            await held.gw.close()
            held.gw = _gateway(nc, tiny_model, port)
        await _paused_and_resumed_elsewhere(nc, job)
        if restarted:
            await held.gw.start()
        # nothing was lost: the pause saved every call answered before it, so the next step is step 3, untold
        assert await asyncio.to_thread(steps.step) == 3.0


async def _attempt_recorded(nc, model_id: str, attempt: int = 1) -> bool:
    return (await _record(nc, model_id)).attempt == attempt


async def test_a_node_lost_while_its_gateway_was_away_is_told_once_by_the_next(nc, stack, tiny_model, agents):
    """The other side of the above: the model's record carries what the last gateway knew, so one started after
    the session's node went away (killed, back under its name: a new attempt from the last save) still tells the
    next training call that the calls since the save were lost, once; the step after goes on from the save."""
    async with a_session(nc, tiny_model, agents) as held:
        steps = held.steps
        assert await asyncio.to_thread(steps.step) == 1.0
        await asyncio.to_thread(lambda: steps.tc.save_state("kept").result())
        model = steps.tc.model_id
        job = (await _record(nc, model)).job
        await wait_for(lambda: _checkpointed(nc, job), timeout=60, what="the save stored as the job's checkpoint")
        assert await asyncio.to_thread(steps.step) == 2.0  # lost with the node
        await wait_for(lambda: _attempt_recorded(nc, model), timeout=60, what="the model's record at attempt 1")
        port = held.gw.port
        await held.gw.close()
        agents.kill("box")
        agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
        await wait_for(lambda: _state(nc, job, "running", 2), timeout=120, what="attempt 2 running from the save")
        held.gw = _gateway(nc, tiny_model, port)
        await held.gw.start()
        with pytest.raises(Exception, match="went away"):
            await asyncio.to_thread(steps.step)
        assert await asyncio.to_thread(steps.step) == 2.0  # from the save at step 1, told once


async def _checkpointed(nc, job: str) -> bool:
    return "checkpoint at step" in (await get_job(nc, job)).message


async def _taken_over(nc, steps: Steps, model_id: str, by_other_than: str) -> str:
    """The model's calls taken over by the gateway the client's requests now reach: the one that ran them looks gone
    (its liveness record deleted, as LIVE_S after its last beat) until the other takes the model at a call of the
    client's (a sample: it changes nothing), or runs it as before."""
    kv = await nc.jetstream().key_value(names.TINKER_KV)

    async def taken() -> str | None:
        await kv.delete(gateway_key(by_other_than))  # it writes it again every LIVE_S / 3: deleted each look
        await asyncio.to_thread(lambda: steps.tc.forward(steps.batch, "cross_entropy").result())
        pump = (await _record(nc, model_id)).pump
        return pump if pump != by_other_than else None

    return await wait_for(taken, timeout=120, interval=0.3, what=f"a gateway other than {by_other_than} running it")


async def test_a_move_told_by_one_gateway_is_not_told_again_by_the_other(nc, stack, tiny_model, agents):
    """Two gateways behind a balancer that sends the client to one, then the other. The first ran the model's
    calls, then the second took it over, saw the session's node go away and told the client once; the client went
    on from its save. When the first takes the model back, its own route is what it knew before the move: it must
    not tell the client the same move a second time (the steps since were not lost)."""
    async with behind_a_balancer(nc, tiny_model, agents) as b:
        steps, model, job, front = b.steps, b.model, b.job, b.front
        front.ports[0] = b.gateways[1].port
        second = await _taken_over(nc, steps, model, b.first)
        agents.kill("box")
        agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
        await wait_for(lambda: _state(nc, job, "running", 2), timeout=120, what="attempt 2 running from the save")
        with pytest.raises(Exception, match="went away"):  # told once, by the second
            await asyncio.to_thread(steps.step)
        assert await asyncio.to_thread(steps.step) == 2.0  # from the save
        # the second's record says attempt 2 (as a gateway writes it after its calls, long before it could look gone)
        await wait_for(lambda: _attempt_recorded(nc, model, 2), timeout=60, what="the model's record at attempt 2")
        front.ports[0] = b.gateways[0].port
        assert await _taken_over(nc, steps, model, second) == b.first
        assert await asyncio.to_thread(steps.step) == 3.0  # nothing lost since the notice: not told again


@pytest.mark.parametrize("back_on", ["box", "other"])
async def test_a_session_whose_agent_shut_down_tells_the_next_training_call(nc, stack, tiny_model, agents, back_on):
    """The session's agent is stopped (SIGTERM: a deploy, a restart of the service) while the client is between
    calls: its trainer is killed, the job handed back to the queue, and the session goes on from its last save as a
    new attempt, on the node come back or on another. The step after the save is lost: the next training call must
    say so."""
    async with a_session(nc, tiny_model, agents) as held:
        steps = held.steps
        assert await asyncio.to_thread(steps.step) == 1.0
        await asyncio.to_thread(lambda: steps.tc.save_state("kept").result())
        job = (await _record(nc, steps.tc.model_id)).job
        await wait_for(lambda: _checkpointed(nc, job), timeout=60, what="the save stored as the job's checkpoint")
        assert await asyncio.to_thread(steps.step) == 2.0  # lost with the trainer
        assert agents.terminate("box") == 0
        agents.start(back_on, gpus=None, offer_cpu=True, trainer=None, interval=0.25)
        running = await wait_for(lambda: _state(nc, job, "running", 2), timeout=120, what="attempt 2 from the save")
        assert running.node == back_on, running
        with pytest.raises(Exception, match="went away"):  # found: step 2 again, from the save at step 1, untold
            await asyncio.to_thread(steps.step)


async def test_a_node_lost_after_a_pause_before_any_call_is_not_told_as_a_loss(nc, stack, tiny_model, agents):
    async with a_session(nc, tiny_model, agents) as held:
        steps = held.steps
        job = await saved_then_stepped(nc, steps)
        await _paused_and_resumed_elsewhere(nc, job)  # attempt 2, from the pause's checkpoint at step 2
        agents.kill("box")  # before any call reached attempt 2: it ran nothing, lost nothing
        agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
        await wait_for(lambda: _state(nc, job, "running", 3), timeout=120, what="attempt 3 running")
        assert await asyncio.to_thread(steps.step) == 3.0  # found: 'went away ... load_state it'


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "in a session group"])
async def test_a_pause_landing_on_a_steps_calls_in_flight_runs_each_once(nc, services, tiny_model, agents, grouped):
    """A step's forward_backward and optim_step sent at once through the gateway, and the session paused through
    the jobs API as they run (before, between or after them, as it falls): the gateway's calls went to attempt n,
    the node answers 'ask again' or 'runs attempt n+1 here', the gateway resumes the session and sends them again
    under their call ids. Each step is counted once, in order, alone and in a session group."""
    await start_stack(services, dataclasses.replace(STACK_CONFIG, co_train="same-tenant" if grouped else "off"))
    async with a_session(nc, tiny_model, agents) as held:
        steps = held.steps
        assert await asyncio.to_thread(steps.step) == 1.0
        job = (await _record(nc, steps.tc.model_id)).job
        api, counted = names.jobs_api("acme"), []
        for i in range(3):

            def sent():
                fb = steps.tc.forward_backward(steps.batch, "cross_entropy")
                return fb, steps.tc.optim_step(steps.types.AdamParams(learning_rate=1e-2))

            fb, opt = await asyncio.to_thread(sent)
            await bus.request(nc, api.pause, JobQuery(job), JobReply | Error)  # the gateway resumes it for the calls
            await asyncio.to_thread(fb.result)
            counted.append((await asyncio.to_thread(opt.result)).metrics[STEP_METRIC])
        counted.append(await asyncio.to_thread(steps.step))
        assert counted == [2.0, 3.0, 4.0, 5.0], counted
        assert (await get_job(nc, job)).attempt >= 2  # at least one pause landed
