"""A soak, run by hand (not in CI): nats-server SIGKILLed mid-job and restarted, over and over; no job is lost.

JETLORA_SOAK=50 .venv/bin/python -m pytest -q -s tests/test_soak.py
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import nats
import pytest

from schemas.jobs import Accepted
from services.embedded import EmbeddedNats
from schemas import names
from tests.conftest import ROOT, Agents, answering, get_job, submit, wait_state
from tests.qa import pairs

ROUNDS = int(os.environ.get("JETLORA_SOAK", "0"))
DOWN_S = 3.0  # how long the server stays dead: the scheduler's 3 s lease lapses meanwhile
pytestmark = pytest.mark.skipif(not ROUNDS, reason="a soak of many server restarts; set JETLORA_SOAK=N to run it")


@pytest.mark.timeout(60 + 30 * ROUNDS)
async def test_nats_server_killed_mid_job_again_and_again_loses_no_job(tmp_path):
    server = EmbeddedNats(store_dir=tmp_path / "nats", websocket=False).start()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "services.cli", kind, "--nats", server.url, "--heartbeat-interval", "0.25"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"{kind}.log", "ab"),
        )
        for kind in ("scheduler", "artifacts")
    ]
    agents = Agents(server.url, tmp_path)
    agents.start("n1", gpus="4096", interval=0.25, hold_s=4.0)
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    outcomes: dict[str, str] = {}
    try:
        await answering(nc, names.LIST_JOBS)
        for i in range(ROUNDS):
            reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), "label": f"r{i}"})
            assert isinstance(reply, Accepted), reply
            await wait_state(nc, reply.job, "running", timeout=60)
            server.kill()
            await asyncio.sleep(DOWN_S)  # the fault itself: a server that is down this long
            server.start()
            try:
                job = await wait_state(nc, reply.job, ("succeeded", "failed", "cancelled"), timeout=90)
                outcomes[reply.job] = job.state
            except AssertionError:
                outcomes[reply.job] = "lost"
            print(f"round {i + 1}/{ROUNDS}: {reply.job} {outcomes[reply.job]}", flush=True)
        for job_id in outcomes:  # and the scheduler still knows every one of them
            assert (await get_job(nc, job_id)).id == job_id
    finally:
        agents.close()
        for p in procs:
            p.terminate()
            p.wait(15)
        await nc.close()
        server.stop()
    lost = [j for j, s in outcomes.items() if s != "succeeded"]
    print(f"{ROUNDS} restarts mid-job: {ROUNDS - len(lost)} succeeded, {len(lost)} not: {lost}")
    assert not lost, (lost, (tmp_path / "scheduler.log").read_text()[-3000:])
