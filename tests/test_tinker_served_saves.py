"""A sampler path stays sampleable after the session that saved it has ended, even once that session's records are
deleted (retention 0 here): create_sampling_client(model_path=...) from a new client, and the OpenAI-compatible
route, sample it on the tenant's serving sampler (a session job of the base, which fetches the stored save on
demand) with the same greedy tokens the training session gave; deleted, it is a 404."""

from __future__ import annotations

import asyncio
import os

import pytest

from schemas.tinker_store import ModelRecord, model_key
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from tests.conftest import wait_for, wait_nodes
from tests.qa import QA_PAIRS
from tests.test_tinker_api import client, datums, key_for

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")
PROMPT = QA_PAIRS[0][0] + " "


def greedy(sampler, tokens: list[int]) -> list[int]:
    from tinker import types

    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    return sampler.sample(types.ModelInput.from_ints(tokens), 1, params).result().sequences[0].tokens


def train_and_save(gw: Gateway, key: str) -> dict:
    from tinker import types

    with client(gw, key) as sc:  # its end finishes the session: its job stops
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        tokenizer = tc.get_tokenizer()
        batch, _ = datums(tokenizer, types)
        before = tc.save_weights_for_sampler("before").result().path
        for _ in range(8):
            tc.forward_backward(batch, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        path = tc.save_weights_for_sampler("after-8").result().path
        prompt = tokenizer.encode(PROMPT)
        return {"path": path, "model": tc.model_id, "prompt": prompt, "tokenizer": tokenizer,
                "trained": greedy(sc.create_sampling_client(model_path=path).result(), prompt),
                "untrained": greedy(sc.create_sampling_client(model_path=before).result(), prompt)}  # fmt: skip


def after_the_end(gw: Gateway, key: str, saved: dict) -> dict:
    import openai
    import tinker

    with client(gw, key) as sc:
        out = {"tinker": greedy(sc.create_sampling_client(model_path=saved["path"]).result(), saved["prompt"])}
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0)
        answer = oai.completions.create(model=saved["path"], prompt=PROMPT, max_tokens=6, temperature=0)
        out["openai"] = answer.choices[0].text
        rest = tinker.RestClient(base_url=f"http://127.0.0.1:{gw.port}", api_key=key)
        rest.delete_checkpoint_from_tinker_path(saved["path"]).result()
        try:
            sc.create_sampling_client(model_path=saved["path"]).result()
            out["deleted"] = "sampled"
        except tinker.NotFoundError as e:
            out["deleted"] = str(e)
    return out


async def test_a_sampler_path_outlives_its_session_and_its_records(nc, stack, tiny_model, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0,
                 tinker_settings=TinkerSettings(retention_s=0))  # fmt: skip
    await gw.start()
    try:
        key = await key_for(nc, "acme")
        saved = await asyncio.to_thread(train_and_save, gw, key)
        assert saved["trained"] != saved["untrained"], saved  # the save is the trained adapter
        store = await Store(nc).open()
        gone = lambda: store.get(store.kv, model_key("acme", saved["model"]), ModelRecord)  # noqa: E731
        await wait_for(lambda: _none(gone), timeout=60)  # finished, and its records deleted (retention 0)
        out = await asyncio.to_thread(after_the_end, gw, key, saved)
    finally:
        await gw.close()
    assert out["tinker"] == saved["trained"], (out, saved)  # on the serving sampler, the same greedy tokens
    assert out["openai"] == saved["tokenizer"].decode(saved["trained"], skip_special_tokens=True), out
    assert "no sampler weights of yours" in out["deleted"], out


async def _none(read) -> bool:
    return await read() is None
