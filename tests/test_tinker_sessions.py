"""A Tinker training session lives as long as its client needs it, and no longer holds a device than it is used:
one left idle is checkpointed and its device freed, and the next call resumes it exactly where it was; one whose
node is killed goes on on another node from its last save, and the client is told so once."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from schemas import names
from schemas.job_status import JobList, JobListQuery
from services import bus
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from tests.conftest import STACK_CONFIG, get_job, list_nodes, start_stack, states_of, wait_for, wait_nodes
from tests.test_tinker_api import client, datums, key_for

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")
IDLE_S = 10.0


@pytest.fixture(params=["alone", "in a session group"])
async def gateway(request, services, nc, tiny_model):
    """Each test twice: the session in a trainer of its own (co-training off), and as a member of a session group
    (the default policy: a session founds a group that its tenant's next sessions join). A session with no call
    for IDLE_S is paused, its device freed (alone, what lets another session of box's one device start)."""
    async for gw in _gateway(request.param, services, nc, tiny_model, idle_s=IDLE_S):
        yield gw


@pytest.fixture(params=["alone", "in a session group"])
async def steady_gateway(request, services, nc, tiny_model):
    """The same, its sessions not paused for idling: on a busy machine two calls, or an agent's start between them,
    can be more than IDLE_S apart, and a pause then is an attempt more than a test of a move counts."""
    async for gw in _gateway(request.param, services, nc, tiny_model, idle_s=900):
        yield gw


async def _gateway(param: str, services, nc, tiny_model, idle_s: float):
    co_train = "off" if param == "alone" else "same-tenant"
    await start_stack(services, dataclasses.replace(STACK_CONFIG, co_train=co_train))
    # a pause for a silent client (no heartbeat for silence_s) is another test's: on a busy machine the client's
    # heartbeats, answered by this process's loop, can lapse for 30 s and pause the session before its idle pause
    settings = TinkerSettings(idle_s=idle_s, silence_s=600)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0, tinker_settings=settings)
    await gw.start()
    yield gw
    await gw.close()


async def job_of(nc, model_id: str):
    jobs = await bus.request(nc, names.jobs_api("acme").jobs, JobListQuery(), JobList)
    return next(j for j in jobs.jobs if j.label.endswith(model_id))


class Loop:
    """A training client in a thread of its own (the tinker client blocks), one step at a time."""

    def __init__(self, gw: Gateway, key: str) -> None:
        self.sc = client(gw, key)
        self.tc = self.sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        from tinker import types

        self.types = types
        self.batch, _ = datums(self.tc.get_tokenizer(), types)

    def step(self) -> None:
        self.tc.forward_backward(self.batch, "cross_entropy").result()
        self.tc.optim_step(self.types.AdamParams(learning_rate=1e-2)).result()

    def logprobs(self) -> list[list[float]]:
        out = self.tc.forward(self.batch, "cross_entropy").result()
        return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


async def test_an_idle_session_frees_its_device_and_the_next_call_resumes_it(nc, gateway, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    loop = await asyncio.to_thread(Loop, gateway, await key_for(nc, "acme"))
    await asyncio.to_thread(loop.step)
    saved = await asyncio.to_thread(lambda: loop.tc.save_state("before-idle").result().path)
    sampler = await asyncio.to_thread(lambda: loop.tc.save_weights_for_sampler("s1").result().path)
    before = await asyncio.to_thread(loop.logprobs)
    job = await job_of(nc, loop.tc.model_id)
    paused = await wait_for(
        lambda: _state(nc, job.id, "paused"), timeout=IDLE_S + 60, what="the idle session checkpointed and paused"
    )
    assert "no call for 10 s" in paused.message, paused
    await wait_for(lambda: _device_free(nc, "box"), timeout=10, what="box's device free")
    after = await asyncio.to_thread(loop.logprobs)  # the next call resumes it from its checkpoint
    assert after == before
    # resumed as the next attempt: read from its history, as the job may idle again (IDLE_S) before a read of it
    resumed = [e for e in await states_of(nc, job.id) if e.state == "running" and e.attempt > paused.attempt]
    assert {e.attempt for e in resumed} == {paused.attempt + 1}, resumed

    def saves_still_there() -> list:  # what it saved before idling came back with it
        loop.tc.load_state(saved).result()
        sampling = loop.sc.create_sampling_client(model_path=sampler).result()
        prompt = loop.types.ModelInput.from_ints(loop.batch[0].model_input.to_ints()[:4])
        return sampling.sample(prompt, 1, loop.types.SamplingParams(max_tokens=2, seed=1)).result().sequences

    assert len(await asyncio.to_thread(saves_still_there)) == 1
    loop.sc.close("success")


async def test_a_session_whose_node_is_killed_goes_on_elsewhere_from_its_last_save(nc, steady_gateway, agents):
    gateway = steady_gateway
    agents.start("a1", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    loop = await asyncio.to_thread(Loop, gateway, await key_for(nc, "acme"))
    await asyncio.to_thread(loop.step)
    await asyncio.to_thread(lambda: loop.tc.save_state("kept").result())
    before = await asyncio.to_thread(loop.logprobs)
    job = await job_of(nc, loop.tc.model_id)
    await wait_for(lambda: _checkpointed(nc, job.id), timeout=30, what="the save stored as the job's checkpoint")
    agents.start("a2", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 2)
    agents.kill("a1")
    moved = await wait_for(lambda: _moved(nc, job.id), timeout=60, what="the session running on a2")
    assert moved.node == "a2" and moved.attempt == 2, moved
    with pytest.raises(Exception, match="went away") as told:  # the client is told once, with what to do
        await asyncio.to_thread(loop.logprobs)
    assert "load_state" in str(told.value)
    assert await asyncio.to_thread(loop.logprobs) == before  # it went on from the save
    loop.sc.close("success")


async def _state(nc, job_id: str, state: str):
    j = await get_job(nc, job_id)
    return j if j.state == state else None


async def _device_free(nc, node: str) -> bool:
    return all(not d.jobs for n in await list_nodes(nc) if n.node == node for d in n.devices)


async def _checkpointed(nc, job_id: str) -> bool:
    return "checkpoint at step" in (await get_job(nc, job_id)).message


async def _moved(nc, job_id: str):
    j = await get_job(nc, job_id)
    return j if j.state == "running" and j.attempt >= 2 else None


async def test_a_new_training_client_starts_from_a_saved_state_of_another(nc, gateway, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    loop = await asyncio.to_thread(Loop, gateway, await key_for(nc, "acme"))
    await asyncio.to_thread(loop.step)
    path = await asyncio.to_thread(lambda: loop.tc.save_state("first").result().path)
    before = await asyncio.to_thread(loop.logprobs)

    def resumed() -> tuple[str, list[list[float]]]:
        tc = loop.sc.create_training_client_from_state_with_optimizer(path).result()
        out = tc.forward(loop.batch, "cross_entropy").result()
        tc.forward_backward(loop.batch, "cross_entropy").result()
        tc.optim_step(loop.types.AdamParams(learning_rate=1e-2)).result()  # and it trains on from there
        return tc.model_id, [o["logprobs"].tolist() for o in out.loss_fn_outputs]

    model_id, after = await asyncio.to_thread(resumed)
    assert model_id != loop.tc.model_id and after == before
    # the step's answer goes out before its Progress is stored (762e4de): the job's step follows it
    job = await wait_for(lambda: _at_least_step(nc, model_id, 2), timeout=30, what="the job's step 2 stored")
    assert job.step == 2, job  # the optimizer's state came with it: step 1 was the first session's
    loop.sc.close("success")


async def _at_least_step(nc, model_id: str, step: int):
    job = await job_of(nc, model_id)
    return job if job.step >= step else None
