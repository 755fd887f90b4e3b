"""Tinker sessions share a device (#57): on a node with one device, a training client, the same tenant's base-model
sampler and a second training client run at once, as members of one session group (one process holding the base
once), each with its own adapter, optimizer and random state. Before, the sampler's session queued behind the
training client's for as long as its client used it (no answer in 60 s)."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from tests.conftest import STACK_CONFIG, get_job, list_nodes, start_stack, wait_for, wait_nodes
from tests.test_tinker_api import client, datums, key_for
from tests.test_tinker_sessions import job_of

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture
async def gateway(services, nc, tiny_model):
    """The stack with the default co-training policy (same-tenant): a tenant's sessions share a process."""
    await start_stack(services, dataclasses.replace(STACK_CONFIG, co_train="same-tenant", misses=8))
    # not paused for a silent client (test_tinker_silence's): on a busy machine the client's heartbeats, answered by
    # this process's loop, can lapse for 30 s, and the test reads its sessions running
    settings = TinkerSettings(silence_s=600)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0, tinker_settings=settings)
    await gw.start()
    yield gw
    await gw.close()


async def test_training_clients_and_a_base_sampler_share_one_device(nc, gateway, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    sc = client(gateway, await key_for(nc, "acme"))
    from tinker import types

    def first_steps():
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        batch, _ = datums(tc.get_tokenizer(), types)
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return tc, batch

    tc, batch = await asyncio.to_thread(first_steps)
    prompt = types.ModelInput.from_ints(batch[0].model_input.to_ints()[:4])

    def base_sample():  # the base beside the training client: answered, not queued behind it
        sampler = sc.create_sampling_client(base_model="tiny").result()
        params = types.SamplingParams(max_tokens=3, seed=7, temperature=1.0)
        return sampler, sampler.sample(prompt, 2, params).result(timeout=90).sequences

    sampler, sequences = await asyncio.to_thread(base_sample)
    assert len(sequences) == 2 and all(len(s.tokens) == 3 for s in sequences), sequences

    def second_client():  # a second training client, the same seed: it starts where the first started
        tc2 = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        tc2.forward_backward(batch, "cross_entropy").result()
        tc2.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return tc2

    tc2 = await asyncio.to_thread(second_client)
    jobs = [await job_of(nc, m) for m in (tc.model_id, tc2.model_id)]
    jobs.append(await job_of(nc, sampler_model(sc, sampler)))
    running = [await get_job(nc, j.id) for j in jobs]
    assert all(j.state == "running" and j.node == "box" for j in running), running
    groups = {j.group for j in running}
    assert len(groups) == 1 and None not in groups, f"one session group holds all three: {groups}"

    async def on_box():  # as box's heartbeats say: the one after the second client's start may be on its way
        (node,) = [n for n in await list_nodes(nc) if n.node == "box"]
        return sorted(j for d in node.devices for j in d.jobs) == sorted(j.id for j in jobs)

    await wait_for(on_box, timeout=10, what="box's heartbeat listing the three on its devices")

    def logprobs(c):
        return [o["logprobs"].tolist() for o in c.forward(batch, "cross_entropy").result().loss_fn_outputs]

    # each member's adapter is its own: one step of each from the same seed on the same data, the same weights
    one, two = await asyncio.to_thread(logprobs, tc), await asyncio.to_thread(logprobs, tc2)
    assert all(abs(a - b) < 1e-4 for x, y in zip(one, two) for a, b in zip(x, y)), "two members drifted apart"
    await asyncio.to_thread(lambda: tc.optim_step(types.AdamParams(learning_rate=1e-2)).result())
    await asyncio.to_thread(lambda: tc.forward_backward(batch, "cross_entropy").result())
    await asyncio.to_thread(lambda: tc.optim_step(types.AdamParams(learning_rate=1e-2)).result())
    moved = await asyncio.to_thread(logprobs, tc)
    assert await asyncio.to_thread(logprobs, tc2) == two, "training one member moved another's adapter"
    assert moved != one
    # the base sampler samples with its adapter off, whatever its neighbours trained: the same draw again
    again = await asyncio.to_thread(
        lambda: sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3, seed=7, temperature=1.0)).result()
    )
    assert [s.tokens for s in again.sequences] == [s.tokens for s in sequences]
    sc.close("success")

    async def ended():
        states = [(await get_job(nc, j.id)).state for j in jobs]
        return states if all(s in ("stopped", "succeeded", "paused", "cancelled") for s in states) else None

    await wait_for(ended, timeout=90, what="the three sessions ended with their client")


def sampler_model(sc, sampler) -> str:
    """The model id of a base sampler's session (its sampling session id less ':sample')."""
    return sampler._sampling_session_id.removesuffix(":sample")
