"""Review of #63's bounds under a client's retry: the official client sends every POST with an X-Idempotency-Key
that it keeps across its retries (tinker/_base_client.py: a 5xx, a timeout, a connection lost). create_session
ignores it, so a retry whose first try's answer was lost (the gateway killed after the write, a proxy timing out)
makes a second session, which holds a max_sessions place until the reaper finds it silent: a tenant at its bound
is refused its own retry. The same key must answer the same session."""

from __future__ import annotations

import os

import aiohttp
import pytest

from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from tests.test_tinker_api import key_for

pytestmark = pytest.mark.timeout(120)
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture
async def gateways(stack, nc, tiny_model):
    """Two gateways on one NATS, as a retry may reach another one."""
    gws = [
        Gateway(
            nc,
            {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")},
            port=0,
            tinker_settings=TinkerSettings(max_sessions=1),
        )  # fmt: skip
        for _ in range(2)
    ]
    for gw in gws:
        await gw.start()
    yield gws
    for gw in gws:
        await gw.close()


async def test_a_create_session_sent_again_with_its_idempotency_key_answers_the_same_session(nc, gateways):
    key = await key_for(nc, "acme")
    headers = {"X-API-Key": key, "X-Idempotency-Key": "stainless-python-retry-5b1f0c6e"}
    answers = []
    async with aiohttp.ClientSession(headers=headers) as http:
        for gw in gateways:  # the first try's answer lost; the retry reaches the other gateway
            async with http.post(f"http://127.0.0.1:{gw.port}/api/v1/create_session", json={}) as r:
                answers.append((r.status, await r.json()))
        async with http.post(
            f"http://127.0.0.1:{gateways[0].port}/api/v1/create_session",
            json={},
            headers={"X-Idempotency-Key": "stainless-python-retry-another"},
        ) as r:
            other = (r.status, await r.json())
    assert [s for s, _ in answers] == [200, 200], answers
    assert answers[0][1]["session_id"] == answers[1][1]["session_id"], answers
    assert other[0] == 400 and "max_sessions" in str(other[1]), other  # a new session is still bounded
