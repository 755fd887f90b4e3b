"""A scheduler's memory projected by hand from heartbeats and statuses, for tests of what its checks choose: nodes
of one-job devices, running jobs adopted as running there, tenants' queues. Nothing is sent (its connection has
no JetStream), so a check's choices are what a test looks at; `checking` cancels the pauses it started."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from schemas.job_status import JobStatus, StoredRequest
from schemas.jobs import JobRequest
from schemas.nodes import Device, Heartbeat, RunningAttempt
from services.scheduler.config import TenantQuota
from services.scheduler.core import SchedulerConfig, SchedulerCore
from services.scheduler.pausing import Pausing
from services.scheduler.preemption import Preemption

MIB = 16384


class NoBus:
    """What SchedulerCore asks of its connection when it is only projected into (nothing is written here)."""

    def jetstream(self):
        return None


def projected_core(weights: dict[str, int] | None = None) -> SchedulerCore:
    """A core with no minimum run time (any running job may be chosen) and the tenants' weights given."""
    quotas = {tenant: TenantQuota(weight=w) for tenant, w in (weights or {}).items()}
    return SchedulerCore(NoBus(), SchedulerConfig(min_run_s=0.0, quotas=quotas))  # type: ignore[arg-type]


def running(core: SchedulerCore, node: str, jobs: list[tuple[str, str]], size: int = 4, preempted_at: float = 0.0):
    """`node` has `size` devices; its first ones run one (job, tenant) each, the rest are free."""
    devices = [Device(index=i, total_mib=MIB, free_mib=MIB) for i in range(size)]
    for i, (job, _) in enumerate(jobs):
        devices[i].free_mib, devices[i].jobs = 0, [job]
    attempts = [RunningAttempt(job=j, attempt=1, devices=[i], state="running") for i, (j, _) in enumerate(jobs)]
    core.fleet.heard(Heartbeat(node=node, agent_version="t", devices=devices, attempts=attempts))
    for i, (job, tenant) in enumerate(jobs):
        status = JobStatus(state="running", node=node, device=i, attempt=1, preempted_at=preempted_at)
        adopt(core, job, tenant, status)


def queued(core: SchedulerCore, job: str, tenant: str, devices: int = 1) -> None:
    adopt(core, job, tenant, JobStatus(), devices)


def adopt(core: SchedulerCore, job: str, tenant: str, status: JobStatus, devices: int = 1) -> None:
    request = JobRequest(model="m", base_dir="/models/m", gpu_mib=8000, devices=devices)
    core.adopt(StoredRequest(id=job, request=request, created=time.time(), tenant=tenant), status, 1)


@contextlib.asynccontextmanager
async def checking(core: SchedulerCore) -> AsyncIterator[Preemption]:
    """The core's preemption check; the pauses it sends, which have no node to go to here, cancelled after."""
    try:
        preemption = Preemption(core, Pausing(core))
        preemption.budget_s = 10.0  # not cut short at 5 ms on a busy machine: its choice is what is looked at
        yield preemption
    finally:
        for task in list(core.tasks):
            task.cancel()
        await asyncio.gather(*core.tasks, return_exceptions=True)
