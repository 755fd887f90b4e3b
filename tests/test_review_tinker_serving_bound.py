"""Review of #63's serving samplers against max_models: a stored sampler save sampled after its session ended is
served by the tenant's serving sampler of its base and LoRA layout (serving.py), a session job of its own on a
device, made without a place in the tenant's max_models bound. A tenant at max_models=1 that saved at two ranks
then has two serving jobs beside its training model: one job per rank it ever saved at, unbounded. Each serving
sampler must take a place in the bound (given back when its job ends), or the sample is a 400 naming
max_models."""

from __future__ import annotations

import asyncio
import os

import pytest

from schemas.tinker_store import ModelRecord
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from tests.conftest import wait_nodes
from tests.test_tinker_api import client, key_for

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")


def save_at(gw: Gateway, key: str, rank: int) -> str:
    with client(gw, key) as sc:  # its end finishes the session: its job stops, its place is given back
        tc = sc.create_lora_training_client(base_model="tiny", rank=rank, seed=0, train_unembed=False).result()
        return tc.save_weights_for_sampler(f"rank-{rank}").result().path


def sample_both(gw: Gateway, key: str, paths: list[str]) -> dict:
    import tinker
    from tinker import types

    out: dict = {}
    with client(gw, key) as sc:
        sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()  # 1 of 1
        for path in paths:
            try:
                sampler = sc.create_sampling_client(model_path=path).result()
                params = types.SamplingParams(max_tokens=2, temperature=0.0)
                out[path] = len(sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result().sequences)
            except tinker.BadRequestError as e:
                out[path] = str(e)
    return out


async def test_serving_samplers_count_against_max_models(nc, stack, tiny_model, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0,
                 tinker_settings=TinkerSettings(max_models=1))  # fmt: skip
    await gw.start()
    try:
        key = await key_for(nc, "acme")
        paths = [await asyncio.to_thread(save_at, gw, key, rank) for rank in (2, 8)]
        out = await asyncio.to_thread(sample_both, gw, key, paths)
        store = await Store(nc).open()
        serving = [m for m in await store.scan(store.kv, "model.acme.>", ModelRecord) if m.id.startswith("serve-")]
        served = [p for p, r in out.items() if not isinstance(r, str)]
        assert all("max_models" in r for r in out.values() if isinstance(r, str)), out
        assert not served, f"max_models=1, yet a training model and {len(serving)} serving jobs served {out}"
    finally:
        await gw.close()
