"""The stand-in co-training group (tests/programs/hold_group.py) with the real scheduler and agent: what the
control-plane tests and bench/chaos.py place groups with. Jobs of one tenant queued together share one group on
one device; one paused goes on from its step, in a group again; each ends once, with its own adapter."""

from __future__ import annotations

import pytest

from schemas import names
from schemas.jobs import Accepted
from services.scheduler.core import SchedulerConfig
from services.scheduler.service import Scheduler
from services.artifacts.service import ArtifactService
from tests.conftest import at_step, submit, wait_for, wait_state
from tests.qa import pairs

pytestmark = pytest.mark.timeout(120)


async def test_the_stand_in_group_holds_queued_jobs_of_a_tenant_on_one_device(services, nc, agents):
    await services.start(lambda c: Scheduler(c, SchedulerConfig(co_train="same-tenant", heartbeat_interval=0.25)))
    await services.start(lambda c: ArtifactService(c))
    body = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": 1000}
    jobs = []
    for _ in range(3):
        reply = await submit(nc, body)
        assert isinstance(reply, Accepted), reply
        jobs.append(reply.job)
    # 30 steps of 0.33 s: the pause asked at step 3 lands well before the job's end even when this process (the
    # scheduler's too) stalls for seconds on a busy machine; it had 2 s at 10 steps in 3 s
    agents.start("n1", gpus="8192", hold_s=10.0, interval=0.25, env={"HOLD_STEPS": "30"})
    running = [await wait_state(nc, j, "running", timeout=30) for j in jobs]
    assert len({(r.node, r.device, r.group) for r in running}) == 1 and running[0].group, running
    await wait_for(lambda: at_step(nc, jobs[0], 3), timeout=30, what="the first job at step 3")
    await bus_pause(nc, jobs[0])
    paused = await wait_state(nc, jobs[0], "paused", timeout=30)
    await bus_resume(nc, jobs[0])
    done = [await wait_state(nc, j, ("succeeded", "failed", "cancelled"), timeout=60) for j in jobs]
    assert [d.state for d in done] == ["succeeded"] * 3, done
    assert done[0].attempt == 2 and paused.step >= 3
    assert len({d.artifacts[0].name for d in done}) == 3


async def bus_pause(nc, job: str) -> None:
    from schemas.jobs import Error
    from schemas.job_status import JobQuery, JobReply
    from services import bus

    reply = await bus.request(nc, names.PAUSE, JobQuery(job), JobReply | Error)
    assert isinstance(reply, JobReply), reply


async def bus_resume(nc, job: str) -> None:
    from schemas.jobs import Error
    from schemas.job_status import JobQuery, JobReply
    from services import bus

    reply = await bus.request(nc, names.RESUME, JobQuery(job), JobReply | Error)
    assert isinstance(reply, JobReply), reply
