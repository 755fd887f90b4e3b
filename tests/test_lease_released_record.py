"""An older attempt of a job that comes late never trains once a newer attempt released the job's trainer lease.
Attempt 1 is assigned to n0, a node that never answers it (its assignment is kept, as in a frozen agent's socket);
the job's next attempt runs to its end on n1, a real agent, which lets the lease go; then attempt 1's assignment
reaches n1 (the scheduler stopped, so nothing ends it there first). Before, a release deleted the entry: the late
attempt found none, took it and started its trainer, work thrown away (fenced, but wasted). The entry now says which
attempt released it, and an older (or the same) attempt does not start. Real nats-server, scheduler, agent, trainer."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from schemas import names
from schemas.jobs import Accepted
from schemas.nodes import CPU_DEVICE, AssignAccepted
from services.scheduler.core import SchedulerConfig
from tests.conftest import start_stack, submit, wait_for, wait_nodes, wait_state
from tests.harness.node import ScriptedNode
from tests.harness.trainers import Trainers, holder
from tests.qa import pairs

pytestmark = pytest.mark.timeout(300)
INTERVAL = 0.25
TRAIN = {"max_steps": 20, "batch_size": 1, "max_seq_length": 64, "logging_steps": 10}
DOES_NOT_START = "does not start"  # the agent's word for an attempt the entry says is older (job_run)


async def test_an_attempt_older_than_the_one_that_released_the_lease_never_trains(nc, services, agents, tiny_model):
    await start_stack(
        services, SchedulerConfig(co_train="off", heartbeat_interval=INTERVAL, misses=3, assign_timeout=1.0)
    )
    n0 = ScriptedNode(nc, "n0", interval=INTERVAL)
    n0.answer_assignments = False
    await n0.start()
    await wait_nodes(nc, 1)
    request = {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "accelerator": "any", "retries": 2}
    reply = await submit(nc, {**request, "train": TRAIN})
    assert isinstance(reply, Accepted), reply
    await wait_for(lambda: n0.assignments, what="attempt 1 assigned to n0")
    late = n0.assignments[0]
    assert late.attempt == 1, late
    await n0.close()  # gone: the job's next attempt goes to n1
    agents.start("n1", gpus=None, offer_cpu=True, trainer=None, interval=INTERVAL)
    done = await wait_state(nc, reply.job, ("succeeded", "failed", "cancelled"), timeout=120)
    assert done.state == "succeeded" and done.node == "n1" and done.attempt > 1, done
    (released,) = await wait_for(lambda: _let_go(nc, reply.job), what="n1 letting the entry go")
    sched_stop, sched_task, _ = services.running[0]  # the scheduler: nothing ends the late attempt before it acts
    await services.stop(sched_stop, sched_task)
    trainers = Trainers([agents.tmp / "n1"], reply.job)
    stop = asyncio.Event()
    watching = asyncio.create_task(trainers.watch(stop))
    try:
        answer = await nc.request(
            names.node("n1").assign, msgspec.json.encode(msgspec.structs.replace(late, device=CPU_DEVICE)), timeout=10
        )
        assert isinstance(msgspec.json.decode(answer.data, type=AssignAccepted), AssignAccepted)
        await wait_for(
            lambda: 1 in trainers.pids or DOES_NOT_START in agents.log("n1"),
            timeout=60,
            what="n1 starting attempt 1's trainer, or saying it does not start",
        )
    finally:
        stop.set()
        await watching
    after = await holder(nc, reply.job)
    assert 1 not in trainers.pids, f"attempt 1's trainer started after attempt {done.attempt} let go: {after}"
    assert released is not None, "the entry was deleted: nothing tells a late attempt that it is older"
    assert after == released, f"the entry changed after the late attempt came: {after} (was {released})"


async def _let_go(nc, job: str):
    entry = await holder(nc, job)
    return [entry] if entry is None or entry.released else None
