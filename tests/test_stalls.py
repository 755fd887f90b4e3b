"""A scheduler that is alive but slow or cut off: fenced leadership, memory that follows only stored writes,
requests that never wait on each other, and why-it-waits that costs no writes. Real nats-server, real scheduler
classes; a node that answers late or never is a ScriptedNode on the bus (tests/harness/node.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import nats
import pytest

from schemas import names, nats_subjects
from schemas.jobs import Accepted, Error, JobRequest
from schemas.job_status import JobQuery, JobReply, JobStatus, StoredRequest
from services import bus
from services.scheduler.fence import Deposed
from services.scheduler.service import Scheduler
from services.scheduler.store import JobStore
from tests.conftest import STACK_CONFIG, InProcess, get_job, retrying, submit, wait_for, wait_state
from tests.harness.node import ScriptedNode
from tests.harness.proxy import NatsProxy
from tests.qa import pairs

JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}
JOB_BYTES = msgspec.json.encode(JOB)


async def test_a_deposed_schedulers_late_write_is_refused_by_the_store(nc):
    js = nc.jetstream()
    kv = await js.key_value(names.JOBS_KV)
    old, new = JobStore(js, kv), JobStore(js, kv)
    await old.take_term("old", lambda: True)
    await old.write_status("j1", JobStatus(state="running", node="n1", attempt=1))
    await new.take_term("new", lambda: True)  # a standby took over while the old leader was frozen
    with pytest.raises(Deposed):
        await old.write_status("j1", JobStatus(state="succeeded", node="n1", attempt=1))
    with pytest.raises(Deposed):
        await old.mark_active("j2")
    assert (await new.status("j1"))[0].state == "running"  # the late write left nothing behind
    await new.write_status("j1", JobStatus(state="queued", attempt=1))
    assert (await new.status("j1"))[0].state == "queued"


async def test_a_leader_cut_off_from_nats_steps_down_before_a_standby_leads(nats_server, nc):
    """The leader's connection blackholed (as a partition looks: nothing closes): it stops leading on its own clock,
    and only then does the standby take the lease; healed, it stands by."""
    proxy = NatsProxy(nats_server.url).start()
    cut_off, direct = InProcess(proxy.url), InProcess(nats_server.url)
    try:
        a, *_ = await cut_off.start(lambda c: Scheduler(c, STACK_CONFIG, holder="a"))
        await asyncio.wait_for(a.leading.wait(), 10)
        b, *_ = await direct.start(lambda c: Scheduler(c, STACK_CONFIG, holder="b"))
        times: dict[str, float] = {}

        async def watch() -> None:
            while "b" not in times:
                if "a" not in times and not a.leading.is_set():
                    times["a"] = time.monotonic()
                if b.leading.is_set():
                    times["b"] = time.monotonic()
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        started = time.monotonic()
        proxy.blackhole()
        await asyncio.wait_for(watcher, 20)
        assert "a" in times and times["a"] < times["b"], times  # never two leaders, even for a moment
        assert times["a"] - started < bus.LEASE_TTL_S, times
        proxy.heal()  # a request may still reach the old leader's endpoints before they are gone: clients retry
        reply = await retrying(lambda: submit(nc, {**JOB, "idempotency_key": "after-heal"}), bus.RequestError)
        assert isinstance(reply, Accepted)
        await wait_for(lambda: reply.job in b.core.jobs, what="the new leader to hold the job")
        assert not a.leading.is_set() and reply.job not in a.core.jobs
    finally:
        await cut_off.close()
        await direct.close()
        proxy.close()


async def test_a_status_write_that_fails_changes_nothing_in_memory(nc, stack):
    """The end of a job whose write times out once: the job keeps its device until the write is stored (the old
    code freed the device first and placed the next job on it while the first was still 'running')."""
    node = await ScriptedNode(nc, "n1").start()
    try:
        first = (await submit(nc, JOB)).job
        await wait_for(lambda: first in node.running, what="the first job on the node")
        await node.report(first, "running")
        await wait_state(nc, first, "running")
        second = (await submit(nc, JOB)).job
        real = stack.core.store.write_status
        failed = asyncio.Event()

        async def times_out_once(job, status, revision=0):
            if job == first and status.state == "succeeded" and not failed.is_set():
                failed.set()
                raise nats.errors.TimeoutError
            return await real(job, status, revision)

        stack.core.store.write_status = times_out_once
        await node.report(first, "succeeded")
        await asyncio.wait_for(failed.wait(), 10)
        while (await get_job(nc, first)).state != "succeeded":  # until the redelivered event is stored
            job = stack.core.jobs[first]
            assert job.status.state == "running" and stack.core.fleet.reserved.get(("n1", 0)) == first
            assert second not in node.running, "the second job was placed on a device the first still holds"
            await asyncio.sleep(0.05)
        await wait_for(lambda: second in node.running, timeout=20, what="the second job on the freed device")
    finally:
        await node.close()


async def test_a_cancel_of_a_queued_job_whose_write_fails_leaves_it_queued(nc, stack):
    node = await ScriptedNode(nc, "n1").start()
    try:
        busy = (await submit(nc, JOB)).job
        await wait_for(lambda: busy in node.running, what="the device to be taken")
        waiting = (await submit(nc, JOB)).job
        await wait_state(nc, waiting, "queued")
        real = stack.core.store.write_status

        async def unavailable(job, status, revision=0):
            if job == waiting:
                raise nats.errors.TimeoutError
            return await real(job, status, revision)

        stack.core.store.write_status = unavailable
        reply = await bus.request(nc, names.CANCEL, JobQuery(waiting), JobReply | Error)
        assert isinstance(reply, Error), reply  # the asker hears it did not happen
        stack.core.store.write_status = real
        assert waiting in stack.core.queue  # and it did not: the job keeps its place
        await node.report(busy, "succeeded")
        await wait_for(lambda: waiting in node.running, timeout=20, what="the queued job placed once room frees")
    finally:
        await node.close()


async def test_a_cancel_whose_node_does_not_answer_never_replaces_a_finished_job(nc, stack):
    node = await ScriptedNode(nc, "n1").start()
    node.answer_controls = False
    try:
        job = (await submit(nc, JOB)).job
        await wait_for(lambda: job in node.running, what="the job on the node")
        await node.report(job, "running")
        await wait_state(nc, job, "running")
        cancel = asyncio.create_task(bus.request(nc, names.CANCEL, JobQuery(job), JobReply | Error, timeout=10))
        await wait_for(lambda: node.controls, what="the cancel to reach the node")
        await node.report(job, "succeeded")  # the job ends while the cancel waits for the node's answer
        await wait_state(nc, job, "succeeded")
        await cancel  # the node never answered: the old code marked the job cancelled now
        assert (await get_job(nc, job)).state == "succeeded"
        assert (await stack.core.store.status(job))[0].state == "succeeded"
    finally:
        await node.close()


async def test_one_tenants_slow_cancel_does_not_hold_up_another_tenants(nc, stack):
    node = await ScriptedNode(nc, "n1").start()
    node.answer_controls = False  # a cancel waits assign_timeout (2 s) for this node
    try:
        slow = (await bus.request(nc, names.jobs_api("acme").submit, JOB_BYTES, Accepted | Error)).job
        await wait_for(lambda: slow in node.running, what="acme's job on the node")
        other = (await bus.request(nc, names.jobs_api("globex").submit, JOB_BYTES, Accepted | Error)).job
        await wait_state(nc, other, "queued")
        first = asyncio.create_task(bus.request(nc, names.jobs_api("acme").cancel, JobQuery(slow), JobReply | Error))
        await wait_for(lambda: node.controls, what="acme's cancel to reach the node")
        t0 = time.monotonic()
        reply = await bus.request(nc, names.jobs_api("globex").cancel, JobQuery(other), JobReply | Error)
        answered = time.monotonic() - t0
        assert isinstance(reply, JobReply) and reply.job.state == "cancelled", reply
        assert answered < 1.0, f"globex waited {answered:.2f}s behind acme's cancel"
        await first
    finally:
        await node.close()


async def test_why_a_job_waits_is_worked_out_when_asked_not_written_at_every_heartbeat(nc, stack):
    """A node whose free memory changes at every heartbeat and a hundred queued jobs that do not fit: no status is
    written while nothing changes state, and each job still says why it waits."""
    node = ScriptedNode(nc, "n1", mib=8192)
    node.free[0] = 1000  # a serving engine holds most of the device
    await node.start()
    try:
        await wait_for(lambda: stack.core.fleet.nodes.get("n1"), what="the node to be heard")
        jobs = await asyncio.gather(*(submit(nc, {**JOB, "gpu_mib": 8000}) for _ in range(100)))
        ids = [r.job for r in jobs]
        js = nc.jetstream()
        stream = nats_subjects.kv(names.JOBS_KV).stream

        async def writes() -> int:
            return (await js.stream_info(stream)).state.last_seq

        before = await writes()
        for free in range(1000, 1400, 20):  # twenty heartbeats, each with another free figure
            node.free[0] = free
            await wait_for(
                lambda free=free: stack.core.fleet.nodes["n1"].devices[0].free_mib == free, what="a heartbeat"
            )
        assert await writes() - before <= 2, "queued jobs' statuses were rewritten while none changed state"
        job = await get_job(nc, ids[-1])
        assert "insufficient free memory" in job.message and "largest free" in job.message, job.message
    finally:
        await node.close()


async def test_an_active_job_the_store_holds_and_memory_lacks_is_taken_up(nc, services):
    """A job written behind the leader's back (as a deposed leader's write before the new term would be): the
    reconcile loop finds it among the active marks and places it."""
    cfg = dataclasses.replace(STACK_CONFIG, reconcile_interval_s=0.5)
    sched, *_ = await services.start(lambda c: Scheduler(c, cfg))
    await asyncio.wait_for(sched.leading.wait(), 10)
    node = await ScriptedNode(nc, "n1").start()
    try:
        js = nc.jetstream()
        behind = JobStore(js, await js.key_value(names.JOBS_KV))
        request = msgspec.convert(JOB, JobRequest)
        await behind.mark_active("missed")
        await behind.add(StoredRequest(id="missed", request=request, created=time.time(), seq=1))
        await wait_for(lambda: "missed" in node.running, timeout=20, what="the missed job placed")
        assert sched.reconcile.adopted == 1
    finally:
        await node.close()


async def test_an_artifact_service_whose_store_writes_go_unanswered_fails_the_upload_and_serves_the_next(tmp_path):
    """Its object chunks' acks dropped for a while (a JetStream election, as a client sees it): the upload under
    way fails in bounded time and the next is stored. nats-py's publish_async waited forever for a lost ack, and
    the service's chunk subscription with it: every later upload timed out (found by bench/chaos.py)."""
    from services.transfer.sender import UploadError, upload_file
    from tests.conftest import answering, random_file, running_on
    from tests.harness import Stack

    async with Stack(tmp_path) as stack:
        stack.start_artifacts("artifacts")
        nc = await nats.connect(stack.client_url)
        try:
            await answering(nc, names.ARTIFACTS_LIST)
            await running_on(nc, "j1")
            await running_on(nc, "j2")
            src = random_file(tmp_path / "a.bin", 8)
            stack.hold_writes("artifacts", ("$O.",), mode="drop", seconds=4.0)
            try:
                await upload_file(nc, "n1", "j1", "peft", src, timeout=3, attempts=1)
            except UploadError:
                pass  # refused or not acknowledged: either way nothing half-stored, and the service goes on
            stack.release_writes("artifacts")
            info = await asyncio.wait_for(upload_file(nc, "n1", "j2", "peft", src, timeout=15), 60)
            assert info.size == src.stat().st_size
        finally:
            await nc.close()
