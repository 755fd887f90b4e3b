"""A job cancelled out of a co-training group whose process still runs keeps its trainer lease entry until it lapses:
the group's process drops the job at its next step boundary (a step under way goes on computing the job's adapter)
and does not say when it did. Before, the agent let the entry go as soon as the member's run returned, which it does
at once on a cancel, so the job's next attempt on another node (the scheduler's end of a moved attempt takes this
path) could start while the group's process still computed it. Real nats-server, scheduler, agent, and the real
co-training process, SIGSTOPped to hold it where it is when the job is cancelled."""

from __future__ import annotations

import os
import signal

import msgspec
import pytest

from schemas import names
from schemas.job_status import JobQuery, JobReply
from schemas.jobs import SubmitReply
from schemas.nodes import Heartbeat
from services import bus
from services.procs import PID_FILE
from services.scheduler.core import SchedulerConfig
from tests.conftest import get_job, start_stack, submit, wait_for, wait_state
from tests.harness.trainers import holder
from tests.qa import pairs

pytestmark = pytest.mark.timeout(300)
TRAIN = {"learning_rate": 0.005, "batch_size": 1, "max_seq_length": 64, "logging_steps": 1, "max_steps": 100000}


async def test_a_job_cancelled_out_of_a_running_group_keeps_its_entry_while_the_process_may_compute_it(
    services, nc, agents, tiny_model
):
    await start_stack(services, SchedulerConfig(co_train="same-tenant", heartbeat_interval=0.25, misses=8))
    request = {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "accelerator": "cpu", "train": TRAIN}
    jobs = []
    for _ in range(2):  # queued before the node comes: placed together, in one group
        reply = await submit(nc, request)
        assert isinstance(reply, SubmitReply) and reply.job, reply
        jobs.append(reply.job)
    agents.start("n1", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    for j in jobs:
        await wait_state(nc, j, "running", timeout=120)
    group = (await get_job(nc, jobs[0])).group
    assert group is not None and (await get_job(nc, jobs[1])).group == group
    for j in jobs:
        held = await holder(nc, j)
        assert held is not None and (held.node, held.attempt) == ("n1", 1), held
    pid_files = list((agents.tmp / "n1" / "jobs").glob(f"group-{group}-*/{PID_FILE}"))
    assert len(pid_files) == 1, pid_files
    pid = int(pid_files[0].read_text().split()[0])
    beats: list[Heartbeat] = []

    async def heard(msg) -> None:
        beats.append(msgspec.json.decode(msg.data, type=Heartbeat))

    sub = await nc.subscribe(names.node("n1").heartbeat, cb=heard)
    os.kill(pid, signal.SIGSTOP)  # the group's process where it stands: mid-step, for all the agent knows
    try:
        await bus.request(nc, names.jobs_api(None).cancel, JobQuery(jobs[0]), JobReply)
        await wait_state(nc, jobs[0], "cancelled", timeout=30)
        await wait_for(  # the agent is done with the cancelled attempt: its heartbeats no longer list it
            lambda: beats and all(a.job != jobs[0] for a in beats[-1].attempts), timeout=30, what="n1 forgot it"
        )
        left = await holder(nc, jobs[0])
        assert left is not None and (left.node, left.attempt) == ("n1", 1), (
            f"job {jobs[0]}'s trainer lease was let go while its group's process (stopped) still held it: {left}"
        )
    finally:
        os.kill(pid, signal.SIGCONT)
        await sub.unsubscribe()
    assert (await get_job(nc, jobs[1])).state == "running"  # its neighbour goes on
    await bus.request(nc, names.jobs_api(None).cancel, JobQuery(jobs[1]), JobReply)
    await wait_state(nc, jobs[1], "cancelled", timeout=30)
