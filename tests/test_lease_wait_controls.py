"""A cancel or a pause of an attempt that waits for its job's trainer lease is done at once. The job's attempt 1
runs on n1, whose agent is frozen (SIGSTOP of its own pid) with a trainer lease longer than the test: the scheduler
gives the job to n2, whose attempt 2 waits in the trainer lease bucket for n1's entry to lapse. Before, a cancel or
a pause then reached a trainer that had not started and was only marked: the attempt went on waiting until the
lease was free (a minute here), and the job stayed running meanwhile. Real nats-server, scheduler, agents, trainer."""

from __future__ import annotations

import signal
import time

import pytest

from schemas import names
from schemas.job_status import JobQuery, JobReply
from schemas.jobs import Accepted
from services import bus
from services.scheduler.core import SchedulerConfig
from tests.conftest import get_job, start_stack, submit, wait_for, wait_nodes, wait_state
from tests.harness.trainers import holder
from tests.qa import pairs

pytestmark = pytest.mark.timeout(300)
INTERVAL = 0.25  # the scheduler's and the agents' heartbeats; 3 missed: the node is gone (0.75 s)
LEASE_S = 60.0  # n1's trainer lease: far past the test's deadlines, so only a wait that is given up ends in time
DONE_S = 10.0  # a control of a waiting attempt is reported within this (before: LEASE_S after n1's last renewal)
TRAIN = {"max_steps": 100000, "batch_size": 1, "max_seq_length": 64, "logging_steps": 10}


@pytest.mark.parametrize("action, ended", [("cancel", "cancelled"), ("pause", "paused")])
async def test_a_control_of_an_attempt_waiting_for_the_trainer_lease_is_done_at_once(
    nc, services, agents, tiny_model, action, ended
):
    await start_stack(services, SchedulerConfig(co_train="off", heartbeat_interval=INTERVAL, misses=3))
    for node in ("n1", "n2"):
        agents.start(
            node, gpus=None, offer_cpu=True, trainer=None, interval=INTERVAL, extra=("--trainer-lease-s", str(LEASE_S))
        )
    await wait_nodes(nc, 2, timeout=60)
    request = {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "accelerator": "cpu", "retries": 1}
    reply = await submit(nc, {**request, "train": TRAIN})
    assert isinstance(reply, Accepted), reply
    first = (await wait_state(nc, reply.job, "running", timeout=120)).node
    other = "n2" if first == "n1" else "n1"
    agents.procs[first].send_signal(signal.SIGSTOP)
    try:
        waiting = await wait_for(
            lambda: _waiting(nc, reply.job, first), timeout=60, what=f"attempt 2 waiting for {first}'s trainer lease"
        )
        assert waiting.node == other and waiting.attempt == 2, waiting
        asked = time.monotonic()
        await bus.request(nc, getattr(names.jobs_api(None), action), JobQuery(reply.job), JobReply)
        done = await wait_state(nc, reply.job, ended, timeout=DONE_S)
        took = time.monotonic() - asked
        held = await holder(nc, reply.job)
    finally:
        agents.procs[first].send_signal(signal.SIGCONT)
    assert took < DONE_S, f"{action} took {took:.1f} s"
    print(f"{action} of attempt 2, waiting for {first}'s trainer lease, reported {ended} after {took:.2f} s")
    assert done.attempt == 2, done
    assert held is not None and (held.node, held.attempt) == (first, 1), f"the entry is not what was waited on: {held}"


async def _waiting(nc, job: str, frozen: str):
    j = await get_job(nc, job)
    return j if f"waiting for attempt 1 of the job on {frozen}" in j.message else None
