"""A job's priority across tenants and against serving engines is the operator's: a tenant's jobs ask for at most its
ceiling (`--quota acme=priority:P`, 0 unless given), and however high a tenant's job asks, it still pauses for an
engine's reclaim and still yields to a busy engine; an admin's job keeps its priority's effect (real nats-server,
scheduler, artifact service and agents)."""

from __future__ import annotations

import asyncio

import pytest

from schemas import names
from schemas.jobs import Accepted, Rejected, SubmitReply
from schemas.nodes import Reclaim, ReclaimReply
from services import bus
from services.artifacts.service import ArtifactService
from services.scheduler.config import TenantQuota
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import at_step, get_job, states_of, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs
from tests.test_yielding import Metrics, says

JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}
CEILING = 10  # acme's: above the reclaim threshold (0) and an engine's exempt=0
EXEMPT_ABOVE_0 = "compute,poll=0.05,holdoff=0.3,exempt=0"


async def start(services, **config) -> Scheduler:
    """A scheduler with acme's ceiling at CEILING (globex has the default's), and an artifact service."""
    cfg = SchedulerConfig(
        co_train="off", heartbeat_interval=0.25, misses=4, quotas={"acme": TenantQuota(priority=CEILING)}, **config
    )
    sched, *_ = await services.start(lambda c: Scheduler(c, cfg))
    await services.start(lambda c: ArtifactService(c))
    await asyncio.wait_for(sched.leading.wait(), 10)
    return sched


async def submit_as(nc, tenant: str | None, **job) -> SubmitReply:
    if tenant is None:
        return await submit(nc, {**JOB, **job})
    return await bus.request(nc, names.jobs_api(tenant).submit, {**JOB, **job}, SubmitReply)


def test_the_quota_flag_takes_a_priority_ceiling():
    assert TenantQuota.parse("queued:20,devices:4,priority:10") == TenantQuota(queued=20, devices=4, priority=10)
    assert TenantQuota.parse("priority:-5").priority == -5 and TenantQuota.parse("queued:3").priority == 0
    for bad in ("priority:101", "priority:high", "priority:"):
        with pytest.raises(ValueError, match="priority:P"):
            TenantQuota.parse(bad)
    assert SchedulerConfig().quota(None).priority is None  # an admin has no ceiling


async def test_a_tenant_cannot_submit_above_its_ceiling(nc, services):
    await start(services)
    over = await submit_as(nc, "acme", priority=CEILING + 1)
    assert isinstance(over, Rejected) and over.errors[0].field == "priority", over
    reason = over.errors[0].reason
    assert f"at most {CEILING}" in reason and "ask an admin to raise the ceiling" in reason, reason
    unset = await submit_as(nc, "globex", priority=1)  # no ceiling given: 0
    assert isinstance(unset, Rejected) and "at most 0" in unset.errors[0].reason, unset
    for tenant, priority in (("acme", CEILING), ("globex", 0), ("globex", -50), (None, 100)):
        assert isinstance(await submit_as(nc, tenant, priority=priority), Accepted), (tenant, priority)


async def test_a_tenant_job_at_its_ceiling_still_pauses_for_an_engine_an_admins_does_not(nc, services, agents):
    await start(services)
    agents.start("n1", gpus="4096,4096", hold_s=8.0)
    await wait_nodes(nc, 1)
    tenants = (await submit_as(nc, "acme", priority=CEILING)).job
    admins = (await submit_as(nc, None, priority=5)).job  # above --reclaim-pause-priority (0), as today
    for job in (tenants, admins):
        await wait_for(lambda j=job: at_step(nc, j, 2), timeout=30, what=f"job {job} under way")
    devices = {j: (await get_job(nc, j)).device for j in (tenants, admins)}
    for device in devices.values():  # both devices' engines want their memory back
        assert (await bus.request(nc, names.node("n1").reclaim, Reclaim(device=device, mib=2048), ReclaimReply)).ok
    paused = await wait_state(nc, tenants, "paused", timeout=30)
    assert paused.paused_by == f"engine n1/{devices[tenants]}"
    # never paused, read from its history: its 8 s may be over by now on a busy machine
    assert "paused" not in {e.state for e in await states_of(nc, admins)}
    await bus.request(nc, names.node("n1").reclaim, Reclaim(device=devices[tenants], mib=0), ReclaimReply)
    assert (await wait_state(nc, tenants, ("running", "succeeded"), timeout=30)).attempt == 2


async def test_a_tenant_job_at_its_ceiling_still_yields_an_admins_exempt_one_does_not(nc, services, agents):
    """exempt=0 on the agent: an admin's job above priority 0 computes on while the engine serves; a tenant's at
    its ceiling of 10 yields (the Assignment carries the scheduler's engine_priority, never the tenant's number)."""
    await start(services)
    engine = Metrics()
    try:
        agents.start(
            "n1",
            gpus="4096,4096",
            hold_s=12.0,
            extra=("--engine", f"vllm={engine.url}", "--engine-model", "tiny", "--engine-yield", EXEMPT_ABOVE_0),
        )
        await wait_nodes(nc, 1)
        tenants = (await submit_as(nc, "acme", priority=CEILING, gpu_mib=1000)).job
        admins = (await submit_as(nc, None, priority=5, gpu_mib=1000)).job
        for job in (tenants, admins):
            await wait_for(lambda j=job: at_step(nc, j, 1), timeout=30, what=f"job {job} under way")
        engine.set(running=2)
        await says(nc, tenants, "yielding to vllm")
        step = (await get_job(nc, admins)).step
        await wait_for(lambda: at_step(nc, admins, step + 1), timeout=20, what="the admin's job to go on computing")
        assert "yielding" not in (await get_job(nc, admins)).message
        assert "yielding" in (await get_job(nc, tenants)).message
        engine.set(running=0)
        await says(nc, tenants, "training again")
    finally:
        engine.close()
