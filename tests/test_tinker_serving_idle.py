"""What a tenant's idle serving sampler and silent session leave behind (#63).

A serving sampler (what samples a sampler path once its session ended) that is paused for idleness is finished:
its job cancelled, its record and its place in max_models gone (before, the paused job stayed for ever and its
place went back only when the bound was full); the path's next sample makes it again, with the same tokens.

A session paused for silence (its client killed) keeps its places while nobody needs them, and gives them up when
its tenant's bound does: at max_sessions=1 a new client's create_session finishes the silent session at once and is
served (before, it was refused naming max_sessions until the silent one finished, 10 minutes later). The silent
session's paused job ends (cancelled, its checkpoints kept): a paused job cannot stop, and was left paused."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from schemas.job_status import TERMINAL_STATES
from schemas.tinker_store import Holds, ModelRecord, SessionRecord, holds_key, model_key, session_key
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from tests.conftest import ROOT, get_job, wait_for, wait_nodes
from tests.test_tinker_api import client, key_for
from tests.test_tinker_served_saves import greedy, train_and_save
from tests.test_tinker_silence import HOLDER

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")


def sample(gw: Gateway, key: str, saved: dict) -> list[int]:
    with client(gw, key) as sc:
        return greedy(sc.create_sampling_client(model_path=saved["path"]).result(), saved["prompt"])


async def _serving(store: Store, tenant: str) -> list[str]:
    """The serving samplers' places in the tenant's max_models."""
    found = await store.get(store.kv, holds_key(tenant, "models"), Holds)
    return [h.id for h in found[0].held if h.session == ""] if found else []


async def test_an_idle_serving_sampler_is_finished_and_made_again_by_its_next_sample(nc, stack, tiny_model, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0,
                 tinker_settings=TinkerSettings(idle_s=10))  # fmt: skip
    await gw.start()
    try:
        key, store = await key_for(nc, "acme"), await Store(nc).open()
        saved = await asyncio.to_thread(train_and_save, gw, key)
        first = await asyncio.to_thread(sample, gw, key, saved)  # on a serving sampler: its session has ended
        (serving,) = await _serving(store, "acme")
        record, _ = await store.get(store.kv, model_key("acme", serving), ModelRecord)

        async def finished() -> bool:
            gone = await store.get(store.kv, model_key("acme", serving), ModelRecord) is None
            return gone and not await _serving(store, "acme")

        await wait_for(finished, timeout=90, interval=0.5, what="the idle serving sampler finished")
        job = await get_job(nc, record.job)
        again = await asyncio.to_thread(sample, gw, key, saved)
        (serving_again,) = await _serving(store, "acme")
        remade, _ = await store.get(store.kv, model_key("acme", serving_again), ModelRecord)
    finally:
        await gw.close()
    assert job.state == "cancelled", job  # not left paused, its checkpoint stored for nothing
    assert first == saved["trained"] and again == first, (first, again, saved["trained"])
    assert serving_again == serving and remade.job != record.job  # the same sampler, made again as a new job


async def test_a_silent_session_gives_its_place_to_its_tenants_next_session(nc, stack, tiny_model, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0,
                 tinker_settings=TinkerSettings(silence_s=20, max_sessions=1))  # fmt: skip
    await gw.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TINKER_TELEMETRY": "0"}
    key, store = await key_for(nc, "acme"), await Store(nc).open()
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, f"http://127.0.0.1:{gw.port}", key, stdout=subprocess.PIPE, env=env
    )
    try:
        assert holder.stdout is not None
        model_id = (await asyncio.wait_for(holder.stdout.readline(), 120)).decode().strip()
        silent = model_id.split(":")[0]
        holder.send_signal(signal.SIGKILL)
        await holder.wait()

        async def paused() -> bool:
            found = await store.get(store.kv, session_key("acme", silent), SessionRecord)
            return found is not None and found[0].paused

        await wait_for(paused, timeout=90, interval=0.5, what="the killed client's session paused for silence")
        before = await store.get(store.kv, session_key("acme", silent), SessionRecord)

        def new_session() -> str:
            with client(gw, key) as sc:
                sc.create_lora_training_client(base_model="tiny", rank=4, seed=1, train_unembed=False).result()
                return "served"

        answer = await asyncio.to_thread(new_session)
        after, _ = await store.get(store.kv, session_key("acme", silent), SessionRecord)
        record, _ = await store.get(store.kv, model_key("acme", model_id), ModelRecord)

        async def ended() -> bool:
            return (await get_job(nc, record.job)).state in TERMINAL_STATES

        await wait_for(ended, timeout=30, interval=0.5, what="the silent session's paused job ended")
    finally:
        if holder.returncode is None:
            holder.kill()
        await gw.close()
    assert before is not None and before[0].finished is None  # kept its place while nobody needed it
    assert answer == "served"
    assert after.finished is not None  # it gave its place up by finishing, as it would have after end_s
