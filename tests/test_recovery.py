"""The scheduler's recovery and lease under the races a restart brings, and services that cannot start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from nats.js.api import KeyValueConfig

from schemas import names, nats_subjects
from schemas.events import StateChange
from schemas.jobs import JobRequest, Rejected
from schemas.job_status import JobStatus, StoredRequest
from services.embedded import EmbeddedNats
from services.scheduler.lease import Lease
from services.scheduler.service import Scheduler, SchedulerConfig
from services.scheduler.store import JobStore, LoadError
from tests.conftest import ROOT, get_job, kv_keys, submit, wait_for
from tests.qa import pairs

CFG = SchedulerConfig(co_train="off", heartbeat_interval=0.25, misses=4)


async def test_taking_over_a_lease_that_expires_mid_create_never_raises(nc):
    """nats-py's create() reads the key after a refused write; when the old lease expires in between, that read
    raises KeyNotFoundError. Drive that path directly: holders that stop renewing, a successor in a tight loop."""
    js = nc.jetstream()
    bucket = f"{names.LEASE_KV}_race"
    try:
        await js.delete_key_value(bucket)
    except Exception:
        pass
    kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, ttl=1.0))
    holder = Lease(kv, "old", ttl=1.0)
    assert await holder.try_acquire()
    takeovers, tries, contended = 0, 0, 0
    for round_ in range(6):
        successor = Lease(kv, f"new-{round_}", ttl=1.0)
        deadline = time.monotonic() + 10
        while not await successor.try_acquire():  # raises nothing, whatever the timing
            tries += 1
            assert time.monotonic() < deadline, "the expired lease was never taken over"
        takeovers += 1
        contended += successor.contended_reads
        assert await successor.holder_now() == successor.holder
        holder = successor  # and it, too, stops renewing
    await js.delete_key_value(bucket)
    print(f"{takeovers} takeovers after {tries} refused tries; {contended} hit the expired-in-between read")
    assert takeovers == 6


async def test_loading_an_unreadable_bucket_raises_instead_of_reading_as_empty(nc):
    js = nc.jetstream()
    store = JobStore(js, await js.key_value(names.JOBS_KV))
    assert await store.load() == ({}, {})  # empty, and the server says so
    await js.delete_stream(nats_subjects.kv(names.JOBS_KV).stream)
    with pytest.raises(LoadError, match="could not be read"):
        await store.load()


async def test_load_reads_every_job_in_the_bucket(nc):
    js = nc.jetstream()
    store = JobStore(js, await js.key_value(names.JOBS_KV))
    req = msgspec.convert({"model": "tiny", "base_dir": "/m", "data": pairs(1)}, JobRequest)
    for i in range(300):
        await store.add(StoredRequest(id=f"job{i}", request=req, created=time.time(), seq=i))
        if i % 2:
            await store.write_status(f"job{i}", JobStatus(state="running", node="n1", device=0, attempt=1), 0)
    requests, statuses = await store.load()
    assert len(requests) == 300 and len(statuses) == 150
    assert all(r.request.data == [] for r in requests.values())  # the data stays in the bucket


async def test_a_state_of_a_job_the_scheduler_missed_is_taken_up_not_dropped(nc, services):
    """Were a recovery ever to miss a job, its agent's states must not be acknowledged and lost."""
    sched, *_ = await services.start(lambda c: Scheduler(c, CFG))
    await asyncio.wait_for(sched.leading.wait(), 10)
    js = nc.jetstream()
    store = JobStore(js, await js.key_value(names.JOBS_KV))
    req = msgspec.convert({"model": "tiny", "base_dir": "/m", "data": pairs(1)}, JobRequest)
    await store.add(StoredRequest(id="missed", request=req, created=time.time(), seq=99))  # behind its back
    await store.write_status("missed", JobStatus(state="running", node="n1", device=0, attempt=1), 0)
    ev = StateChange(job="missed", state="succeeded", node="n1", attempt=1, message="trained", ts=time.time())
    await js.publish(names.job("missed", "n1", names.ADMIN_TENANT).state, msgspec.json.encode(ev))

    async def known():
        try:
            return await get_job(nc, "missed")
        except Exception:
            return None

    job = await wait_for(known, timeout=15, what="the scheduler to take up the job")
    job = await wait_for(lambda: _state_is(nc, "missed", "succeeded"), timeout=15, what="its state applied")
    assert job.message == "trained"
    status, _ = await store.status("missed")
    assert status.state == "succeeded"


async def _state_is(nc, job_id: str, state: str):
    job = await get_job(nc, job_id)
    return job if job.state == state else None


async def test_a_rejection_lists_every_error_at_once(nc, services):
    sched, *_ = await services.start(lambda c: Scheduler(c, CFG))
    await asyncio.wait_for(sched.leading.wait(), 10)
    reply = await submit(
        nc, {"model": "tiny", "base_dir": "models/tiny", "data": [], "train": {"batch_size": 0}, "colour": "blue"}
    )
    assert isinstance(reply, Rejected)
    assert {e.field for e in reply.errors} == {"data", "base_dir", "train.batch_size", "colour"}, reply.errors
    assert await kv_keys(nc) == []


# --- the command line ---------------------------------------------------------------------------
def _jetlora(*args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        **kw,
    )


def _nats_servers_under(path: Path) -> list[int]:
    """Pids of nats-server processes whose config lies under `path`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"nats-server") and str(path).encode() in b" ".join(cmd):
                pids.append(int(entry.name))
    return pids


async def _until_gone(path: Path, timeout: float = 15.0) -> None:
    await wait_for(
        lambda: not _nats_servers_under(path), timeout=timeout, what=f"the embedded nats-server under {path} to exit"
    )


async def test_up_with_its_dashboard_port_taken_says_why_exits_1_and_leaves_nothing(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = _jetlora(
            "up",
            "--port",
            str(port),
            "--simulate-gpus",
            "4096",
            "--node",
            "box",
            env={"XDG_STATE_HOME": str(tmp_path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 1, (out, err)
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err, err
    await _until_gone(tmp_path)


async def test_up_stops_all_it_started_on_sigterm_and_its_nats_dies_with_it_on_sigkill(tmp_path):
    for sig, code in ((signal.SIGTERM, 0), (signal.SIGKILL, -signal.SIGKILL)):
        state = tmp_path / sig.name
        proc = _jetlora(
            "up",
            "--port",
            "0",
            "--simulate-gpus",
            "4096",
            "--node",
            "box",
            env={"XDG_STATE_HOME": str(state)},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        line = ""
        deadline = time.monotonic() + 60
        while "dashboard:" not in line and time.monotonic() < deadline:
            line = await asyncio.to_thread(proc.stdout.readline)
        assert "dashboard:" in line, "jetlora up did not come up"
        assert _nats_servers_under(state)
        proc.send_signal(sig)
        assert await asyncio.to_thread(proc.wait, 30) == code
        await _until_gone(state)


async def test_a_job_file_over_the_servers_max_payload_is_refused_with_its_size_and_the_limit(tmp_path):
    server = EmbeddedNats(store_dir=tmp_path / "nats", websocket=False, max_payload=64 * 1024).start()
    try:
        job_file = tmp_path / "big.json"
        job_file.write_text(json.dumps({"model": "tiny", "base_dir": "/m", "data": pairs(1) * 2000}))
        proc = _jetlora("submit", str(job_file), "--nats", server.url, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 2, err
        assert "max_payload" in err and "0.1 MiB per message" in err and "Traceback" not in err, err
    finally:
        server.stop()
