"""Fencing reaches the nodes: every command a scheduler sends carries its term, and an agent refuses one of a term
older than the newest it has seen (from the commands it took, and from the lease it reads before it obeys one)."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest
from nats.js.errors import KeyNotFoundError

from schemas import names
from schemas.job_records import request_key
from schemas.jobs import Accepted, JobRequest, SubmitReply, Unsure
from schemas.leadership import LEASE_KEY, LeaseRecord, encode_lease
from schemas.nodes import AssignAccepted, AssignRefused, Assignment, AssignReply, Control, ControlReply
from services import bus
from tests.conftest import answering, list_jobs, submit, wait_for, wait_state
from tests.harness import Stack
from tests.qa import pairs

FAULT_S = 6.0  # twice the lease's TTL: a standby takes over meanwhile


def _request() -> JobRequest:
    return msgspec.convert({"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}, JobRequest)


async def _lease_says(nc, term: int) -> None:
    kv = await nc.jetstream().key_value(names.LEASE_KV)
    await kv.put(LEASE_KEY, encode_lease(LeaseRecord(holder="scheduler-test", term=term)))


async def test_an_agent_refuses_the_commands_of_a_term_older_than_the_lease_or_than_it_has_seen(nc, agents):
    agents.start("n1", gpus="4096,4096", hold_s=30)
    await wait_for(lambda: "agent n1 up" in agents.log("n1"), what="the agent up")
    await _lease_says(nc, 5)
    node = names.node("n1")
    old = await bus.request(
        nc, node.assign, Assignment(job="j-old", device=0, attempt=1, request=_request(), term=4), AssignReply
    )
    assert isinstance(old, AssignRefused) and old.reason.startswith("deposed"), old
    assert "term 4" in old.reason and "term 5" in old.reason
    current = await bus.request(
        nc, node.assign, Assignment(job="j-new", device=0, attempt=1, request=_request(), term=5), AssignReply
    )
    assert isinstance(current, AssignAccepted), current
    # the lease lapses (no scheduler): the node still remembers term 5 from the assignment it took
    kv = await nc.jetstream().key_value(names.LEASE_KV)
    await kv.purge(LEASE_KEY)
    end = await bus.request(nc, node.control, Control("j-new", "end", by="stale", attempt=1, term=4), ControlReply)
    assert not end.ok and end.message.startswith("deposed"), end
    cancel = await bus.request(nc, node.control, Control("j-new", "cancel", attempt=1, term=6), ControlReply)
    assert cancel.ok, cancel
    assert agents.log("n1").count("refused") >= 1 and "scheduler term 4" in agents.log("n1")


@pytest.mark.timeout(120)
async def test_a_deposed_leader_never_ends_what_its_successor_placed_on_a_node_that_joined_in_its_stall(tmp_path):
    """The leader holds a queued job and is frozen past its lease; the standby takes over and places the job on a
    node that joins meanwhile; the old leader, continued, finds in its stale memory that the job is queued at
    attempt 0 while the node runs attempt 1. It must not end it: the job runs on there and succeeds."""
    async with Stack(tmp_path) as stack:
        stack.start_scheduler("a")
        nc = await nats.connect(stack.client_url)
        try:
            await answering(nc, names.LIST_JOBS)
            stack.start_scheduler("b")
            stack.start_artifacts("artifacts")
            reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)})
            assert isinstance(reply, Accepted), reply
            await wait_state(nc, reply.job, "queued")
            stalled = asyncio.create_task(stack.stall_for("a", FAULT_S))
            await wait_for(lambda: "scheduler leading" in stack.log("b"), timeout=20, what="b leading")
            stack.start_agent("n1", gpus="4096", hold_s=FAULT_S + 6)
            running = await wait_state(nc, reply.job, "running", timeout=20)
            assert (running.node, running.attempt) == ("n1", 1)
            await stalled  # a runs again, with heartbeats of n1 buffered that its memory cannot explain
            await wait_for(
                lambda: "stepping down" in stack.log("a") or "stopped leading" in stack.log("a"),
                timeout=10,
                what="the old leader stepping down",
            )
            done = await wait_state(nc, reply.job, ("succeeded", "failed", "cancelled"), timeout=60)
            assert (done.state, done.attempt, done.node) == ("succeeded", 1, "n1"), (done, stack.log("a")[-3000:])
            assert "ending it there" not in stack.log("a"), stack.log("a")[-3000:]
            assert "refused" not in stack.log("n1") or "deposed" in stack.log("n1")
        finally:
            await nc.close()


@pytest.mark.timeout(120)
async def test_a_submission_whose_write_went_unanswered_is_unsure_and_its_retry_is_that_job_not_a_second(tmp_path):
    """The scheduler's write of a job's request is held back 6.5 s (past its 6 s deadline) and lands afterwards:
    the answer is `unknown` with the job id, never "nothing was queued", and the retry with the same idempotency key
    is that job: one job runs, once."""
    async with Stack(tmp_path) as stack:
        stack.start_scheduler("a")
        stack.start_artifacts("artifacts")
        stack.start_agent("n1", gpus="4096", hold_s=0.3)
        nc = await nats.connect(stack.client_url)
        try:
            await answering(nc, names.LIST_JOBS)
            body = {
                "model": "tiny",
                "base_dir": "/models/tiny",
                "data": pairs(1),
                "label": "once",
                "idempotency_key": "k",
            }
            stack.proxy("a").hold_writes(
                prefixes=("$KV.jetlora_jobs.request.",), mode="delay", delay_s=6.5, seconds=6.5
            )
            first = await bus.request(nc, names.SUBMIT, body, SubmitReply, timeout=30)
            assert isinstance(first, Unsure), first
            assert first.job in first.reason and "idempotency_key" in first.reason
            jobs = await nc.jetstream().key_value(names.JOBS_KV)

            async def landed() -> bool:
                try:
                    return bool(await jobs.get(request_key(first.job)))
                except KeyNotFoundError:
                    return False

            await wait_for(landed, timeout=20, what="the held write landing")
            again = await bus.request(nc, names.SUBMIT, body, SubmitReply, timeout=30)
            assert isinstance(again, Accepted) and again.job == first.job, again
            done = await wait_state(nc, first.job, ("succeeded", "failed", "cancelled"), timeout=60)
            assert done.state == "succeeded" and done.attempt == 1, done
            assert [j.id for j in await list_jobs(nc) if j.label == "once"] == [first.job]
        finally:
            await nc.close()
