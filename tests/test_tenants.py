"""Tenants on the bus: each sees, cancels and stops only its own jobs, within its quotas; an admin sees all."""

from __future__ import annotations

import asyncio

from schemas import names
from schemas.jobs import Accepted, Error, Rejected, SubmitReply
from schemas.job_status import JobList, JobListQuery, JobQuery, JobReply
from services import bus
from services.scheduler.core import TenantQuota
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import list_jobs, list_nodes, wait_for, wait_nodes, wait_state
from tests.qa import pairs

JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), "gpu_mib": 1000}


async def as_tenant(nc, tenant: str, verb: str, message, reply_type):
    return await bus.request(nc, getattr(names.jobs_api(tenant), verb), message, reply_type)


async def submit_as(nc, tenant: str, **kw) -> SubmitReply:
    return await as_tenant(nc, tenant, "submit", {**JOB, **kw}, SubmitReply)


async def start(services, **config) -> Scheduler:
    sched, *_ = await services.start(
        lambda c: Scheduler(c, SchedulerConfig(co_train="off", heartbeat_interval=0.25, **config))
    )
    await asyncio.wait_for(sched.leading.wait(), 10)
    return sched


async def test_a_tenant_sees_and_ends_only_its_own_jobs(nc, services):
    await start(services)
    acme = (await submit_as(nc, "acme", label="acme's")).job
    globex = (await submit_as(nc, "globex", label="globex's")).job

    mine = await as_tenant(nc, "globex", "jobs", JobListQuery(), JobList)
    assert [(j.id, j.tenant) for j in mine.jobs] == [(globex, "globex")]
    for verb in ("job", "cancel", "stop"):  # acme's job does not exist for globex
        reply = await as_tenant(nc, "globex", verb, JobQuery(acme), JobReply | Error)
        assert isinstance(reply, Error) and reply.field == "job" and f"no job {acme}" in reply.error
    assert (await wait_state(nc, acme, "queued")).state == "queued"  # untouched

    cancelled = await as_tenant(nc, "acme", "cancel", JobQuery(acme), JobReply)
    assert cancelled.job.state == "cancelled" and cancelled.job.tenant == "acme"
    everyone = {j.id: j.tenant for j in await list_jobs(nc)}  # the admin's listing
    assert everyone == {acme: "acme", globex: "globex"}


async def test_a_tenant_over_its_queued_quota_is_rejected_saying_so(nc, services):
    await start(services, quotas={"acme": TenantQuota(queued=2)})
    first, second = [(await submit_as(nc, "acme")).job for _ in range(2)]
    over = await submit_as(nc, "acme")
    assert isinstance(over, Rejected) and "quota is 2" in over.errors[0].reason, over
    assert isinstance(await submit_as(nc, "globex"), Accepted)  # another tenant is not held back
    await as_tenant(nc, "acme", "cancel", JobQuery(first), JobReply)
    assert isinstance(await submit_as(nc, "acme"), Accepted)  # room again


async def heartbeats_with_a_free_device(nc, node: str, count: int) -> None:
    seen = set()

    async def enough():
        for n in await list_nodes(nc):
            if n.node == node and any(not d.jobs for d in n.devices):
                seen.add(n.last_seen)
        return len(seen) >= count

    await wait_for(enough, timeout=20, what=f"{count} heartbeats of {node} with a free device")


async def test_a_tenant_at_its_device_quota_waits_while_others_run(nc, services, agents):
    """fifo sharing: devices:N is a hard cap (under fair it is the tenant's nominal share; tests/test_fair_share.py)."""
    await start(services, sharing="fifo", quotas={"acme": TenantQuota(devices=1)})
    agents.start("n1", gpus="4096,4096,4096", interval=0.25, hold_s=60)
    await wait_nodes(nc, 1)
    a1 = (await submit_as(nc, "acme")).job
    await wait_state(nc, a1, "running")
    a2 = (await submit_as(nc, "acme")).job
    g1 = (await submit_as(nc, "globex")).job
    await wait_state(nc, g1, "running")  # submitted after a2, placed before it: a2 waits for acme's quota
    await heartbeats_with_a_free_device(nc, "n1", 3)  # placement passes in which a2 must not take that device
    assert (await wait_state(nc, a2, "queued")).node is None
    await as_tenant(nc, "acme", "cancel", JobQuery(a1), JobReply)
    assert (await wait_state(nc, a2, "running", timeout=20)).tenant == "acme"


async def test_an_admin_submission_carries_no_tenant(nc, services):
    await start(services)
    job = (await bus.request(nc, names.SUBMIT, JOB, SubmitReply)).job
    assert [j.tenant for j in await list_jobs(nc) if j.id == job] == [None]


async def test_a_tenant_lists_and_deletes_only_its_own_artifacts(nc, services, agents):
    from schemas.artifacts import ArtifactList, ArtifactQuery, Deleted
    from services.artifacts.service import ArtifactService

    await start(services)
    await services.start(lambda c: ArtifactService(c))
    agents.start("n1", gpus="4096,4096", interval=0.25, hold_s=0.2)
    await wait_nodes(nc, 1)
    mine, theirs = (await submit_as(nc, "acme")).job, (await submit_as(nc, "globex")).job
    for job in (mine, theirs):
        await wait_state(nc, job, "succeeded", timeout=30)

    async def artifacts_of(tenant, **query):
        reply = await bus.request(nc, names.artifacts_api(tenant).list, ArtifactQuery(**query), ArtifactList)
        return [(a.job, a.tenant) for a in reply.artifacts]

    assert await artifacts_of("acme") == [(mine, "acme")]
    assert await artifacts_of("acme", job=theirs) == []
    gone = await bus.request(nc, names.artifacts_api("acme").delete, ArtifactQuery(job=theirs), Deleted)
    assert gone.names == []  # not acme's to delete
    assert await artifacts_of("globex") == [(theirs, "globex")]


async def test_a_retry_at_the_quota_gets_its_job_not_a_quota_error(nc, services):
    await start(services, quotas={"acme": TenantQuota(queued=1)})
    first = await submit_as(nc, "acme", idempotency_key="k1")
    assert isinstance(first, Accepted)
    assert await submit_as(nc, "acme", idempotency_key="k1") == first  # the tenant is at its quota now
    assert isinstance(await submit_as(nc, "acme", idempotency_key="k2"), Rejected)


async def test_concurrent_submissions_never_exceed_the_queued_quota(nc, services):
    """Twelve submissions at once against a queued quota of 2: the count and the write are one step."""
    await start(services, quotas={"acme": TenantQuota(queued=2)})
    for round_ in range(3):
        replies = await asyncio.gather(*(submit_as(nc, "acme", label=f"r{round_}-{i}") for i in range(12)))
        accepted = [r for r in replies if isinstance(r, Accepted)]
        assert len(accepted) == (2 if round_ == 0 else 0), replies
        assert all("its quota is 2" in r.errors[0].reason for r in replies if isinstance(r, Rejected))
    mine = await as_tenant(nc, "acme", "jobs", JobListQuery(), JobList)
    assert sum(j.state == "queued" for j in mine.jobs) == 2
