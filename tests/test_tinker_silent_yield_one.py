"""A full bound finishes as many silent sessions as it needs, not every one (#63, review of e23e2c9).

A session paused for silence keeps its places until its tenant's bound needs one: then it is finished (its client,
if it comes back, finds it finished). A tenant whose two scripts went silent together (a laptop asleep for a
minute) and who opens one session elsewhere at max_sessions=2 needs one place: one silent session gives it, the
other keeps its place and goes on when its client comes back. Before, the bound asked every held session at once
and each silent one was finished."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from schemas.tinker_store import Holds, SessionRecord, holds_key, session_key
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from tests.conftest import ROOT, wait_for
from tests.test_tinker_api import client, key_for

pytestmark = pytest.mark.timeout(240)
os.environ.setdefault("TINKER_TELEMETRY", "0")

QUIET = """
import sys, time
import tinker
sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
print(sc.holder.get_session_id(), flush=True)  # the session is made (and heartbeats) from here on
time.sleep(600)
"""


async def _sessions(store: Store, tenant: str) -> list[str]:
    found = await store.get(store.kv, holds_key(tenant, "sessions"), Holds)
    return [h.id for h in found[0].held] if found else []


async def test_a_full_bound_finishes_one_silent_session_for_one_place(nc, stack, tiny_model):
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0,
                 tinker_settings=TinkerSettings(silence_s=20, max_sessions=2))  # fmt: skip
    await gw.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TINKER_TELEMETRY": "0"}
    key, store = await key_for(nc, "acme"), await Store(nc).open()
    holders = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", QUIET, f"http://127.0.0.1:{gw.port}", key, stdout=subprocess.PIPE, env=env
        )
        for _ in range(2)
    ]
    try:
        silent = []
        for holder in holders:
            assert holder.stdout is not None
            silent.append((await asyncio.wait_for(holder.stdout.readline(), 120)).decode().strip())
        assert sorted(silent) == sorted(await _sessions(store, "acme"))
        for holder in holders:  # both clients cut off at once: neither heartbeats again
            holder.send_signal(signal.SIGKILL)
            await holder.wait()

        async def paused() -> bool:
            found = [await store.get(store.kv, session_key("acme", s), SessionRecord) for s in silent]
            return all(f is not None and f[0].paused for f in found)

        await wait_for(paused, timeout=90, interval=0.5, what="both silent sessions paused")

        sc = await asyncio.to_thread(client, gw, key)
        served = await asyncio.to_thread(lambda: sc.holder.get_session_id())  # its session made: one place needed
        finished = [s for s in silent if (await store.get(store.kv, session_key("acme", s), SessionRecord))[0].finished]
        held = await _sessions(store, "acme")
        await asyncio.to_thread(sc.close, "success")
    finally:
        for holder in holders:
            if holder.returncode is None:
                holder.kill()
        await gw.close()
    assert len(set(silent)) == 2 and served.startswith("sess-") and served in held
    assert len(finished) == 1, finished  # one place was needed: one silent session gave it (before: both)
    assert set(silent) - set(finished) <= set(held)  # the other keeps its place
