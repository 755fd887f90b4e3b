"""Faults with real processes: the nats-server itself killed and restarted mid-job, services killed; nothing lost."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from schemas import names, nats_subjects
from services import bus
from services.transfer.download import download
from services.artifacts.service import ArtifactService
from services.embedded import EmbeddedNats
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import (
    Agents,
    InProcess,
    answering,
    object_names,
    progress_steps,
    random_file,
    run_held_job,
    running_on,
    states_of,
    submit,
    wait_for,
    wait_state,
)
from tests.qa import pairs

CFG = SchedulerConfig(co_train="off", heartbeat_interval=0.25, misses=4)


@pytest.fixture
async def own_server(tmp_path):
    server = EmbeddedNats(store_dir=tmp_path / "nats").start()
    yield server
    server.stop()


async def test_nats_server_killed_and_restarted_mid_job_loses_nothing(own_server, tmp_path):
    nc = await nats.connect(own_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    await bus.ensure_resources(nc)
    services = InProcess(own_server.url)
    agents = Agents(own_server.url, tmp_path)
    try:
        sched, *_ = await services.start(lambda c: Scheduler(c, CFG))
        arts, *_ = await services.start(lambda c: ArtifactService(c))
        await asyncio.wait_for(sched.leading.wait(), 10)
        job_id = await run_held_job(nc, agents, hold_s=6.0)
        await wait_for(lambda: _at_least(nc, job_id, 3), timeout=20, what="a few steps of progress")  # mid-job

        own_server.kill()  # SIGKILL: no goodbye to anyone
        await asyncio.sleep(1.5)  # the fault itself: a server down this long
        own_server.start()  # same port, same JetStream store

        t0 = time.monotonic()
        job = await wait_state(nc, job_id, ("succeeded", "failed"), timeout=60)
        assert job.state == "succeeded", (job.message, agents.log("n1")[-3000:])
        assert [a.kind for a in job.artifacts] == ["peft"]
        assert await progress_steps(nc, job_id) == list(range(1, 11))  # no gap, no duplicate
        await download(nc, job_id, "peft", tmp_path / "a.tar.gz")  # whole: its sha256 is checked
        print(f"recovered and finished {time.monotonic() - t0:.1f}s after the restart")
    finally:
        agents.close()
        await services.close()
        await nc.close()


async def _chunks_stored(nc) -> bool:
    info = await nc.jetstream().stream_info(nats_subjects.objects(names.ARTIFACTS_BUCKET).stream)
    return info.state.messages > 0


async def _at_least(nc, job_id: str, steps: int) -> bool:
    return len(await progress_steps(nc, job_id)) >= steps


def service_proc(kind: str, url: str, tmp_path, *extra):
    import subprocess
    import sys

    from tests.conftest import ROOT

    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", kind, "--nats", url, *extra],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / f"{kind}.log", "ab"),
    )


async def test_the_scheduler_killed_mid_job_loses_nothing_and_assigns_nothing_twice(own_server, tmp_path):
    nc = await nats.connect(own_server.url)
    await bus.ensure_resources(nc)
    services = InProcess(own_server.url)
    agents = Agents(own_server.url, tmp_path)
    sched = service_proc("scheduler", own_server.url, tmp_path, "--heartbeat-interval", "0.25", "--co-train", "off")
    try:
        await services.start(lambda c: ArtifactService(c))
        agents.start("n1", gpus="4096,4096", interval=0.25, hold_s=2.0)
        await answering(nc, names.LIST_JOBS)  # the scheduler's process is up (slow to start on a busy machine)
        ids = []
        for i in range(4):
            reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), "label": f"j{i}"})
            ids.append(reply.job)
        await wait_state(nc, ids[0], "running", timeout=20)
        sched.kill()
        sched.wait()
        await asyncio.sleep(1.0)
        sched = service_proc("scheduler", own_server.url, tmp_path, "--heartbeat-interval", "0.25", "--co-train", "off")
        for jid in ids:
            j = await wait_state(nc, jid, ("succeeded", "failed"), timeout=60)
            assert j.state == "succeeded", j.message
        for jid in ids:
            assert len([e for e in await states_of(nc, jid) if e.state == "preparing"]) == 1
    finally:
        sched.kill()
        agents.close()
        await services.close()
        await nc.close()


async def test_the_artifact_service_killed_mid_upload_leaves_no_half_object_and_the_upload_completes(
    own_server, tmp_path
):
    from services.transfer.download import sha256_file
    from services.transfer.sender import upload_file

    nc = await nats.connect(own_server.url)
    await bus.ensure_resources(nc)
    src = random_file(tmp_path / "big.bin", 300)
    svc = service_proc("artifacts", own_server.url, tmp_path)
    try:
        await answering(nc, names.ARTIFACTS_LIST)
        await running_on(nc, "resilient")
        upload = asyncio.create_task(upload_file(nc, "n1", "resilient", "peft", src, timeout=3))
        await wait_for(lambda: _chunks_stored(nc), timeout=30, what="the upload's first chunks in the store")
        assert not upload.done()
        svc.kill()
        svc.wait()
        assert await object_names(nc) == []  # the part that arrived is not an artifact
        svc = service_proc("artifacts", own_server.url, tmp_path)
        info = await asyncio.wait_for(upload, 90)
        assert info.sha256 == sha256_file(src) and await object_names(nc) == ["resilient/peft"]
        await download(nc, "resilient", "peft", tmp_path / "back.bin")
    finally:
        svc.kill()
        await nc.close()
