"""Interleavings the review found, driven through the real scheduler classes on a real nats-server: a pause while
a job is being placed, a third request under a key two others hold, a state event that comes again late."""

from __future__ import annotations

import asyncio
import time

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas import names
from schemas.events import StateChange
from schemas.jobs import Accepted, Error
from schemas.job_status import JobQuery, JobReply
from services import bus
from services.scheduler.idempotency import IdempotencyKeys
from services.scheduler.store import JobStore
from tests.conftest import get_job, run_held_job, slowed, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs


async def test_a_key_is_held_by_one_request_at_a_time_however_many_wait(nc):
    keys = IdempotencyKeys(JobStore(nc.jetstream(), await nc.jetstream().key_value(names.JOBS_KV)), 60)
    inside, most = 0, 0
    everyone_waits = asyncio.Event()

    async def one() -> None:
        nonlocal inside, most
        async with keys.turn("k"):
            inside += 1
            most = max(most, inside)
            await everyone_waits.wait()  # the first holds the key until the other four wait for it
            inside -= 1

    tasks = [asyncio.create_task(one()) for _ in range(5)]
    await wait_for(lambda: keys._locks.get("k", (None, 0))[1] == 5, what="all five to hold or wait for the key")
    everyone_waits.set()  # each release hands the key to a waiter: the moment the old code forgot the lock
    await asyncio.gather(*tasks)
    assert most == 1 and keys._locks == {}


async def test_three_retries_of_a_rejected_key_make_at_most_one_job(nc, stack):
    """The first try is rejected (no data); the two identical retries that waited behind it make one job."""
    bad = {"model": "tiny", "base_dir": "/models/tiny", "data": [], "idempotency_key": "k1"}
    good = {**bad, "data": pairs(1)}
    replies = await asyncio.gather(submit(nc, bad), submit(nc, good), submit(nc, good))
    jobs = {r.job for r in replies if isinstance(r, Accepted)}
    assert len(jobs) == 1, replies


async def test_pausing_a_job_while_it_is_placed_never_leaves_it_in_two_places(nc, stack, agents):
    """The store's writes slowed to 20 ms, pauses sent the moment jobs are submitted: after each, the job is
    either paused holding nothing, or placed on one node whose reservation is its own, never also queued."""
    stack.core.store.write_status = slowed(stack.core.store.write_status)
    agents.start("n1", gpus="4096", hold_s=30)
    await wait_nodes(nc, 1)
    for _ in range(6):
        reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)})
        answer = await bus.request(nc, names.PAUSE, JobQuery(reply.job), JobReply | Error)
        job = stack.core.jobs[reply.job]
        await wait_for(lambda job=job: job.status.state in ("paused", "running"), timeout=30, what="the job to settle")
        reserved = [slot for slot, j in stack.core.fleet.reserved.items() if j == reply.job]
        if job.status.state == "paused":
            assert job.status.node is None and reserved == [] and reply.job not in stack.core.queue, (
                answer,
                job.status,
            )
        else:
            assert reserved == [(job.status.node, job.status.device)] and reply.job not in stack.core.queue, job.status
            await bus.request(nc, names.CANCEL, JobQuery(reply.job), JobReply | Error)
            await wait_state(nc, reply.job, ("cancelled",), timeout=30)
        stored = (await stack.core.store.status(reply.job))[0]
        assert (stored.state, stored.node) == (job.status.state, job.status.node)


async def test_a_state_event_that_comes_again_after_a_later_one_does_not_undo_it(nc, stack, agents):
    job_id = await run_held_job(nc, agents, node="n1", hold_s=30)
    await wait_state(nc, job_id, ("running",), timeout=30)
    js = nc.jetstream()
    mine = await js.pull_subscribe(
        names.job(job_id, "n1").state, durable="race-test", config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    )
    running = [m for m in await mine.fetch(10, timeout=5) if b'"running"' in m.data][-1]
    paused = StateChange(job=job_id, state="paused", node="n1", attempt=1, message="paused by n1", ts=time.time())
    await js.publish(names.job(job_id, "n1", names.ADMIN_TENANT).state, msgspec.json.encode(paused))
    await wait_state(nc, job_id, ("paused",), timeout=30)
    await stack.events.apply_state(running)  # the earlier event delivered again, as after a failed apply
    assert (await get_job(nc, job_id)).state == "paused"
    assert stack.core.jobs[job_id].status.state == "paused"
    await mine.unsubscribe()
