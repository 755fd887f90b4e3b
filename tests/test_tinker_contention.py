"""Concurrent requests on two gateways at once never pass a tenant's bounds, and never answer 5xx for contention:
create_session and create_model against max_sessions=2 and max_models=2 accept exactly two each (the rest a 400,
which the official client does not retry: it retries 408, 409, 429 and 5xx), a finished session gives its places
back, and sixteen create_model calls in one session all answer, each with its create stored (a retry of one gets
the same request id, and its future is there to fetch). Raw HTTP: the official client sends its creates one at a
time and waits for a node to run each."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from schemas import names
from schemas.tinker_store import Holds, call_key, holds_key
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from tests.test_tinker_api import key_for
from tests.test_tinker_bounds import Api

pytestmark = pytest.mark.timeout(120)
os.environ.setdefault("TINKER_TELEMETRY", "0")
RETRIED = {408, 409, 429}  # and every 5xx: what the official client sends again on its own


@pytest.fixture
async def gateways(stack, nc, tiny_model):
    """Two gateways of one deployment (the same bounds), no node: creates are stored and wait to be placed."""
    settings = TinkerSettings(max_sessions=2, max_models=2)
    models = {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}
    gws = [Gateway(nc, models, port=0, tinker_settings=settings) for _ in range(2)]
    for gw in gws:
        await gw.start()
    yield gws
    for gw in gws:
        await gw.close()


def model_body(session: str, seq: int) -> dict:
    return {"session_id": session, "model_seq_id": seq, "base_model": "tiny",
            "lora_config": {"rank": 4, "train_unembed": False}}  # fmt: skip


def refused_for(outcomes: list[tuple[int, dict]], flag: str) -> list[tuple[int, dict]]:
    """Every answer that is not a 200 must be a 400 naming the bound: none the client would send again."""
    refused = [(status, out) for status, out in outcomes if status != 200]
    for status, out in refused:
        assert status not in RETRIED and status < 500, (status, out)
        assert status == 400 and flag in out["detail"], (status, out)
    return refused


async def test_bounds_hold_for_concurrent_requests_on_two_gateways(nc, gateways):
    key = await key_for(nc, "acme")
    kv = await nc.jetstream().key_value(names.TINKER_KV)
    async with Api(gateways[0], key) as one, Api(gateways[1], key) as two:
        apis = [one, two]
        sessions = await asyncio.gather(*(apis[n % 2].post("create_session", {}) for n in range(10)))
        accepted = [out["session_id"] for status, out in sessions if status == 200]
        assert len(accepted) == 2 and len(refused_for(sessions, "max_sessions")) == 8, sessions
        session = accepted[0]

        models = await asyncio.gather(*(apis[n % 2].post("create_model", model_body(session, n)) for n in range(10)))
        created = [out["request_id"] for status, out in models if status == 200]
        assert len(created) == 2 and len(refused_for(models, "max_models")) == 8, models
        stored = [k for k in await kv.keys() if k.startswith("model.acme.")]
        assert len(stored) == 2, stored  # no record of a refused model: nothing escapes the bound
        futures = await nc.jetstream().key_value(names.TINKER_FUTURES_KV)
        for request in created:  # each accepted create has its future, to fetch from any gateway
            assert (await futures.get(call_key("acme", request))).value

        await one.ok(f"sessions/{session}/finish", {})  # its places go back: a session and two models
        again = (await two.ok("create_session", {}))["session_id"]
        status, out = await one.post("create_model", model_body(again, 0))
        assert status == 200, out
        assert await held(nc, "models") == [f"{again}:train:0"]
        assert sorted(await held(nc, "sessions")) == sorted([accepted[1], again])


async def held(nc, kind: str) -> list[str]:
    kv = await nc.jetstream().key_value(names.TINKER_KV)
    return [h.id for h in msgspec.json.decode((await kv.get(holds_key("acme", kind))).value, type=Holds).held]


async def test_sixteen_concurrent_create_models_in_one_session_all_answer_and_a_retry_finds_the_same(
    nc, stack, tiny_model
):
    models = {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}
    gws = [Gateway(nc, models, port=0) for _ in range(2)]
    for gw in gws:
        await gw.start()
    try:
        key = await key_for(nc, "acme")
        async with Api(gws[0], key) as one, Api(gws[1], key) as two:
            apis = [one, two]
            session = (await one.ok("create_session", {}))["session_id"]
            tries = [apis[n % 2].post("create_model", model_body(session, n)) for n in range(16)]
            first = await asyncio.gather(*tries)
            assert [status for status, _ in first] == [200] * 16, [o for o in first if o[0] != 200]
            ids = [out["request_id"] for _, out in first]
            assert ids == [f"{session}:train:{n}:0" for n in range(16)]
            again = await asyncio.gather(*(apis[(n + 1) % 2].post("create_model", model_body(session, n))
                                           for n in range(16)))  # fmt: skip
            assert [out["request_id"] for _, out in again] == ids  # the client's retry: the same creates
            futures = await nc.jetstream().key_value(names.TINKER_FUTURES_KV)
            for request in ids:
                assert (await futures.get(call_key("acme", request))).value
            async with one.http.get(f"{one.url}/sessions/{session}") as r:
                listed = (await r.json())["training_run_ids"]
            assert sorted(listed) == sorted(f"{session}:train:{n}" for n in range(16))
            assert len(await held(nc, "models")) == 16
    finally:
        for gw in gws:
            await gw.close()
