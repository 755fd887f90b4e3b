"""A client back after its silence is not finished under its own calls (#63, a review of e23e2c9): a session paused
for silence gives its places up when its tenant's bound is full (reaper.yield_silent, a write at the revision it
read), and only a heartbeat said the client was back, up to 10 s after its first call had resumed its jobs; a place
asked for in that window finished the session and cancelled the jobs its client was training again. The call that
resumes a paused job now says the session was heard, first: the finish loses to it, or the call fails, never both."""

from __future__ import annotations

import time

import pytest

from schemas.tinker_store import ModelRecord, SessionRecord, session_key
from services.gateway.tinker.api import TinkerApi
from services.gateway.tinker.futures import CallFailed
from services.gateway.tinker.settings import TinkerSettings


async def test_a_call_that_resumes_a_silent_session_beats_its_finish_and_loses_to_one_before_it(nc, stack):
    api = TinkerApi(nc, None, {}, TinkerSettings(silence_s=20))  # type: ignore[arg-type]
    await api.start()
    try:
        store, trainers, key = api.ctx.store, api.ctx.trainers, session_key("acme", "s1")
        long_ago = time.time() - 120
        silent = SessionRecord(id="s1", tenant="acme", created=long_ago, heard=long_ago, paused=True)
        model = ModelRecord(id="s1:0", tenant="acme", session="s1", base_model="tiny", job="j-none")

        await store.put(store.kv, key, silent)
        await trainers._client_back(model)  # a call on its way to resume the session's paused job
        assert not await api.reaper.yield_silent("acme", "s1")  # the tenant's bound asks for its places: too late
        found = await store.get(store.kv, key, SessionRecord)
        assert found is not None and found[0].finished is None and not found[0].paused

        await store.put(store.kv, key, silent)  # silent again; this time the bound's ask comes first
        assert await api.reaper.yield_silent("acme", "s1")
        with pytest.raises(CallFailed, match="session has ended"):
            await trainers._client_back(model)
    finally:
        await api.close()
