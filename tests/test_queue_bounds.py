"""What the scheduler's queue keeps is bounded by the jobs waiting in it, whatever a tenant submits and cancels:
jobs pinned to nodes nobody has seen, once cancelled, leave no per-node heap behind."""

from __future__ import annotations

from schemas import names
from schemas.jobs import Accepted, Error
from schemas.job_status import JobQuery, JobReply
from services import bus
from tests.conftest import submit, wait_state
from tests.qa import pairs

ROUNDS = 60


async def test_jobs_pinned_to_unseen_nodes_and_cancelled_leave_no_heap(nc, stack):
    queue = stack.core.queue
    for i in range(ROUNDS):
        reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "node": f"ghost{i}"})
        assert isinstance(reply, Accepted), reply
        cancelled = await bus.request(nc, names.CANCEL, JobQuery(reply.job), JobReply | Error)
        assert isinstance(cancelled, JobReply), cancelled
        await wait_state(nc, reply.job, "cancelled")
    assert len(queue) == 0
    assert queue.pinned_heaps() == 0, f"{queue.pinned_heaps()} nodes' heaps held for no queued job"
    assert sum(q.heaps_dropped for q in queue.queues.values()) == ROUNDS


async def test_a_pinned_job_still_waiting_keeps_its_heap_and_is_placed_when_its_node_comes(nc, stack, agents):
    """Dropping a node's heap with its last job loses no job that still waits there."""
    body = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "node": "late"}
    kept, gone = (await submit(nc, body)).job, (await submit(nc, body)).job
    cancelled = await bus.request(nc, names.CANCEL, JobQuery(gone), JobReply | Error)
    assert isinstance(cancelled, JobReply), cancelled
    await wait_state(nc, gone, "cancelled")
    assert stack.core.queue.pinned_heaps() == 1
    agents.start("late", gpus="4096", hold_s=0.2)
    done = await wait_state(nc, kept, ("succeeded", "failed"), timeout=60)
    assert (done.state, done.node, done.attempt) == ("succeeded", "late", 1), done
    assert stack.core.queue.pinned_heaps() == 0
