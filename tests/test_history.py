"""History at scale, in behaviour: finished jobs leave memory and are still answered, retention removes what
expired and keeps what lives, idempotency keys end with their window, and pages hold every job exactly once."""

from __future__ import annotations

import asyncio

import msgspec
from nats.js.api import ObjectMeta
from nats.js.errors import KeyNotFoundError

from schemas import names
from schemas.artifacts import ArtifactMeta
from schemas.events import CheckpointList, EventPage, EventsQuery
from schemas.jobs import Accepted, Error, JobRequest, Rejected
from schemas.job_status import JobList, JobListQuery, JobQuery, JobReply, JobStatus, StoredRequest
from services import bus
from schemas.object_headers import artifact_headers
from services.scheduler.service import Scheduler, SchedulerConfig
from schemas.job_records import LAYOUT, idempotency_key, request_key, status_key
from tests.conftest import get_job, object_names, submit, wait_for, wait_state
from tests.qa import pairs

JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}


async def lead(services, **config) -> Scheduler:
    sched, stop, task = await services.start(
        lambda c: Scheduler(c, SchedulerConfig(co_train="off", heartbeat_interval=0.25, **config))
    )
    await asyncio.wait_for(sched.leading.wait(), 10)
    sched.test_handle = (stop, task)  # type: ignore[attr-defined]
    return sched


async def queued(nc, tenant: str | None = None, **job) -> str:
    reply = await bus.request(nc, names.jobs_api(tenant).submit, {**JOB, **job}, Accepted | Rejected)
    assert isinstance(reply, Accepted), reply
    return reply.job


async def cancel(nc, job: str) -> None:
    reply = await bus.request(nc, names.CANCEL, JobQuery(job), JobReply | Error)
    assert isinstance(reply, JobReply) and reply.job.state == "cancelled", reply


async def page(nc, tenant: str | None = None, **query) -> JobList:
    return await bus.request(nc, names.jobs_api(tenant).jobs, JobListQuery(**query), JobList)


async def every_page(nc, tenant: str | None = None, between=None, **query) -> list[list[str]]:
    pages, after = [], None
    while True:
        reply = await page(nc, tenant, after=after, **query)
        pages.append([j.id for j in reply.jobs])
        if reply.next is None:
            return pages
        after = reply.next
        if between is not None:
            await between()


async def test_a_finished_job_leaves_memory_and_is_still_answered_also_after_a_takeover(nc, services, agents):
    from services.artifacts.service import ArtifactService

    await services.start(lambda c: ArtifactService(c))  # the job's adapter goes there
    sched = await lead(services, finished_in_memory_s=0.0)
    agents.start("n1", gpus="4096", hold_s=0.2)
    ran = await queued(nc, gpu_mib=1000)
    await wait_state(nc, ran, ("succeeded",), timeout=30)
    await wait_for(lambda: ran not in sched.core.jobs, what="the finished job to leave memory")

    assert (await get_job(nc, ran)).state == "succeeded"
    events = await bus.request(nc, names.EVENTS, EventsQuery(job=ran), EventPage)
    assert [e.event.state for e in events.events if hasattr(e.event, "state")][-1] == "succeeded", events
    checkpoints = await bus.request(nc, names.CHECKPOINTS, JobQuery(ran), CheckpointList)
    assert checkpoints.job == ran
    assert [j.id for j in (await page(nc, state="succeeded")).jobs] == [ran]
    assert ran in [j.id for j in (await page(nc)).jobs]

    waiting = await queued(nc, node="elsewhere")  # active: a scheduler that takes over must hold it
    await services.stop(*sched.test_handle)
    successor = await lead(services, finished_in_memory_s=0.0)
    assert set(successor.core.jobs) == {waiting}  # what it needs to lead, not the history
    assert (await get_job(nc, ran)).state == "succeeded"


async def test_retention_removes_an_expired_job_and_keeps_a_live_one(nc, services):
    from services.artifacts.service import ArtifactService
    from services.registry.service import RegistryService

    await services.start(lambda c: ArtifactService(c))
    await services.start(lambda c: RegistryService(c))  # which artifacts its versions reference: none here
    sched = await lead(
        services, finished_in_memory_s=0.0, retention_s=1.0, sweep_interval_s=0.2, retention_artifacts=True
    )
    live = await queued(nc, node="elsewhere")
    old = await queued(nc)
    await nc.jetstream().publish(names.job(old, "n1", names.ADMIN_TENANT).state, b"{}")  # an event of it
    for job in (old, live):  # an artifact of each, as the artifact service stores them
        await put_artifact(nc, job)
    await cancel(nc, old)

    async def gone():
        reply = await bus.request(nc, names.GET_JOB, JobQuery(old), JobReply | Error)
        return isinstance(reply, Error) and "no job" in reply.error

    await wait_for(gone, timeout=20, what="the expired job to be removed")
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    for key in (request_key(old), status_key(old)):
        try:
            await kv.get(key)
            raise AssertionError(f"{key} is still in the jobs bucket")
        except KeyNotFoundError:
            pass
    events = await nc.jetstream().stream_info(names.JOBS_STREAM, subjects_filter=names.job_events(old))
    assert not events.state.subjects, events.state.subjects
    assert [j.id for j in (await page(nc)).jobs] == [live]
    assert (await get_job(nc, live)).state == "queued" and live in sched.core.jobs
    assert await object_names(nc) == [names.artifact_name(live, "peft")]


async def put_artifact(nc, job: str) -> None:
    obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    name = names.artifact_name(job, "peft")
    await obs.put(
        name, b"adapter bytes", meta=ObjectMeta(name=name, headers=artifact_headers(job, "peft", ArtifactMeta()))
    )


async def test_an_idempotency_key_expires_at_the_end_of_its_window(nc, services):
    await lead(services, idempotency_window_s=1.0)
    first = await queued(nc, idempotency_key="nightly-42")
    assert await queued(nc, idempotency_key="nightly-42") == first  # within the window: the same job
    other = {**JOB, "label": "another job", "idempotency_key": "nightly-42"}
    refused = await submit(nc, other)
    assert isinstance(refused, Rejected) and refused.errors[0].field == "idempotency_key", refused

    kv = await nc.jetstream().key_value(names.IDEMPOTENCY_KV)

    async def expired():
        try:
            await kv.get(idempotency_key("/nightly-42"))
            return False
        except KeyNotFoundError:
            return True

    await wait_for(expired, timeout=20, what="the key's record to expire with its window")
    again = await submit(nc, other)
    assert isinstance(again, Accepted) and again.job != first, again


async def test_pages_hold_every_job_exactly_once_while_jobs_are_added(nc, services):
    await lead(services)
    first = [await queued(nc, node="elsewhere") for _ in range(20)]
    mine = [await queued(nc, "acme", node="elsewhere") for _ in range(6)]
    added: list[str] = []

    async def add():
        added.append(await queued(nc, node="elsewhere"))
        added.append(await queued(nc, "acme", node="elsewhere"))

    pages = await every_page(nc, between=add, limit=7)
    seen = [j for p in pages for j in p]
    assert sorted(seen) == sorted(first + mine), "every job there at the start, each once, none added meanwhile"
    assert seen == list(reversed(first + mine)), "newest first"

    acme = [j for p in await every_page(nc, "acme", between=add, limit=4) for j in p]
    assert acme == list(reversed(mine + [j for j in added if j in set(acme)])) and set(mine) <= set(acme)
    assert len(acme) == len(set(acme))

    for j in first[:5]:
        await cancel(nc, j)
    cancelled = [j for p in await every_page(nc, state="cancelled", limit=2) for j in p]
    assert cancelled == list(reversed(first[:5]))
    queued_now = [j for p in await every_page(nc, state="queued", limit=9) for j in p]
    assert len(queued_now) == len(set(queued_now)) and set(queued_now) == set(first[5:] + mine + added)


async def test_a_bucket_from_before_the_index_is_indexed_once_and_led_from(nc, services):
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    enc = msgspec.json.Encoder()
    for i, state in enumerate(("succeeded", "queued")):
        job_id = f"old{i}"
        stored = StoredRequest(id=job_id, request=msgspec.convert(JOB, type=JobRequest), created=1000.0 + i, seq=i + 1)
        await kv.put(request_key(job_id), enc.encode(stored))
        await kv.put(status_key(job_id), enc.encode(JobStatus(state=state, updated=1000.0 + i)))
    sched = await lead(services)
    assert set(sched.core.jobs) == {"old1"}  # the queued one; the finished one is history
    assert [j.id for j in (await page(nc)).jobs] == ["old1", "old0"]
    assert [j.id for j in (await page(nc, state="succeeded")).jobs] == ["old0"]
    assert (await kv.get(LAYOUT)).value
    assert (await get_job(nc, "old0")).state == "succeeded"


async def test_the_index_walks_back_a_sparse_and_a_dense_tenant_exactly(nc):
    from services.scheduler.index import JobIndex

    index = JobIndex(nc)
    dense = [str(await index.submitted("a", f"a{i}")) for i in range(600)]
    sparse = [str(await index.submitted("b", f"b{i}")) for i in range(3)]
    for i in range(1000):  # a gap: the walk back to a's entries widens past it, then narrows to a's newest
        await index.submitted("c", f"c{i}")
    for tenant, seqs in (("a", dense), ("b", sparse)):
        walked, before = [], await index.end()
        while entries := await index.newest_before(names.job_index_submitted(tenant), before, 7):
            walked += [str(e.seq) for e in entries]
            before = entries[-1].seq
        assert walked == list(reversed(seqs)), tenant
    assert [e.data for e in await index.newest_before(names.job_index_submitted(), await index.end(), 5)] == [
        b"c999",
        b"c998",
        b"c997",
        b"c996",
        b"c995",
    ]
