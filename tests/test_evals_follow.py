"""The evals service finishes a run as its job ends, with nobody reading the run, and follows no job that is no
run's: it watches the status of each unfinished run's job alone, so the jobs bucket has no consumer of its while no
run is unfinished (it followed every status write before: ~3 a job, a tenth of the scheduler process's CPU in a
burst). Real NATS and evals service; the job's records are written as the scheduler writes them."""

from __future__ import annotations

import time

import msgspec

from schemas import names, nats_subjects
from schemas.evals import EvalRun
from schemas.job_records import request_key, status_key
from schemas.job_status import JobStatus, StoredRequest
from schemas.jobs import JobRequest
from services.evals.service import EvalsService
from tests.conftest import wait_for

enc = msgspec.json.Encoder()


async def _followed(nc) -> list[str]:
    """What the jobs bucket's consumers with a subscriber follow (a watch that ended leaves its consumer behind,
    unbound, until the server's inactivity threshold removes it)."""
    infos = await nc.jetstream().consumers_info(nats_subjects.kv(names.JOBS_KV).stream)
    prefix = nats_subjects.kv(names.JOBS_KV).prefix
    return sorted((i.config.filter_subject or "").removeprefix(prefix) for i in infos if i.push_bound)


async def _job(kv, job: str, state: str) -> None:
    request = JobRequest(model="m", base_dir="/models/m", data=[{"q": "q?", "a": "a."}])
    await kv.put(request_key(job), enc.encode(StoredRequest(id=job, request=request, created=time.time())))
    await kv.put(status_key(job), enc.encode(JobStatus(state=state, message=state, updated=time.time())))


async def test_a_run_is_finished_as_its_job_ends_and_no_other_job_is_followed(nc, services):
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    await _job(kv, "ab12cd34ab12cd34", "running")
    await _job(kv, "ffff0000ffff0000", "running")  # no run's job
    service, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(service.ready.is_set, timeout=10, what="the evals service")

    run = EvalRun(id="r1", eval="e", job="ab12cd34ab12cd34", base_model="m", dataset="d", state="in_progress")
    await service.store.put_run(run)

    async def followed() -> bool:
        return await _followed(nc) == [status_key("ab12cd34ab12cd34")]

    await wait_for(followed, timeout=10, what="a watch of the run's job alone")
    await kv.put(status_key("ffff0000ffff0000"), enc.encode(JobStatus(state="failed", updated=time.time())))
    await kv.put(status_key("ab12cd34ab12cd34"), enc.encode(JobStatus(state="failed", message="boom")))

    async def finished() -> bool:  # read from the bucket: a read through the service would refresh it itself
        stored = await service.store.run(None, "r1")
        return stored is not None and stored.state == "failed"

    await wait_for(finished, timeout=10, what="the run finished by the follower")
    stored = await service.store.run(None, "r1")
    assert stored is not None and stored.message == "boom", stored

    async def let_go() -> bool:
        return await _followed(nc) == []

    await wait_for(let_go, timeout=10, what="the watch of the ended job let go")
