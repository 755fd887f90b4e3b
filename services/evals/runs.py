"""An eval run placed as a job (train.method eval) on the tenant's own submit subject, and its record kept up with the
job's: read through the jobs bucket's stored format (services/job_records.py), so a run's state answers while the
scheduler is between leaders. A run that ended is finished once, by the follower (follow.py) as its job ends or on
the first read after, whichever comes first (compare-and-set): its summary is read from its `eval` artifact and
stored with the run, so results stay per adapter version."""

from __future__ import annotations

import secrets
import time

import msgspec
from nats.aio.client import Client

from schemas import names
from schemas.evals import EvalDef, EvalJob, EvalRun, RunRequest, RunState
from schemas.jobs import Accepted, Error, JobQuery, JobReply, Rejected
from schemas.registry import AdapterQuery, AdapterReply
from services import bus
from services.evals.store import EvalStore
from services.job_records import JobRecords

ASK_TIMEOUT_S = 10.0
STATE_OF_JOB: dict[str, RunState] = {
    "queued": "queued",
    "assigned": "queued",
    "paused": "queued",
    "preparing": "in_progress",
    "running": "in_progress",
    "uploading": "in_progress",
    "succeeded": "completed",
    "failed": "failed",
    "stopped": "failed",
    "cancelled": "canceled",
}
ENDED = ("completed", "failed", "canceled")
FIELDS = {"dataset.name": "dataset", "init_adapter.name": "adapter", "init_adapter.version": "version"}


class RunError(Exception):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


async def target(nc: Client, q: RunRequest, tenant: str | None) -> tuple[str, str | None, int | None]:
    """(base model, adapter, version) the run grades: a registered version of the tenant's, or a base model."""
    if (q.adapter is None) == (q.base_model is None):
        raise RunError("name what to grade: an adapter (NAME[@V]) or a base model, one of them", "adapter")
    if q.adapter is None:
        assert q.base_model is not None
        return q.base_model, None, None
    reply = await bus.request(
        nc, names.ADAPTERS.show, AdapterQuery(name=q.adapter), AdapterReply | Error, ASK_TIMEOUT_S
    )
    if isinstance(reply, Error) or (tenant is not None and reply.alias.tenant != tenant):
        raise RunError(f"no adapter named {q.adapter}; `jetlora adapters ls` lists them", "adapter")
    version = q.version or reply.alias.current
    found = next((v for v in reply.versions if v.version == version), None)
    if found is None:
        raise RunError(
            f"{q.adapter} has no version {version}; `jetlora adapters show {q.adapter}` lists its versions", "version"
        )
    return found.base_model, q.adapter, found.version


async def place(nc: Client, store: EvalStore, e: EvalDef, q: RunRequest, tenant: str | None) -> EvalRun:
    """Submit the run's job on the tenant's subject (the scheduler checks it as any of the tenant's jobs) and store
    the run; RunError names the field at fault."""
    model, adapter, version = await target(nc, q, tenant)
    dataset = q.dataset or e.dataset
    if dataset is None:
        raise RunError(f"eval {e.name} names no dataset: give the run one (its items, an rft dataset)", "dataset")
    run_id = f"evalrun_{secrets.token_hex(8)}"
    request = {
        "model": model,
        "base_dir": q.base_dir,
        "accelerator": q.accelerator,
        "dataset": {"name": dataset},
        "train": {"method": "eval"},
        "evaluate": EvalJob(eval=e.name, run=run_id, criteria=e.criteria, sampling=q.sampling or e.sampling),
        "label": f"eval {e.name} run {run_id}",
    }
    if adapter is not None:
        request["init_adapter"] = {"name": adapter, "version": version}
    reply = await bus.request(nc, names.jobs_api(tenant).submit, request, Accepted | Rejected, ASK_TIMEOUT_S)
    if isinstance(reply, Rejected):
        first = reply.errors[0]
        raise RunError(
            f"the run's job was refused: {first.field}: {first.reason}", FIELDS.get(first.field, first.field)
        )
    now = time.time()
    run = EvalRun(
        id=run_id,
        eval=e.name,
        tenant=tenant,
        job=reply.job,
        base_model=model,
        adapter=adapter,
        version=version,
        dataset=dataset,
        created=now,
        updated=now,
        name=q.name or f"{e.name} on {adapter + '@' + str(version) if adapter else model}",
        metadata=q.metadata,
        source=q.source,
        sampling=q.sampling or e.sampling,
    )
    await store.put_run(run)
    return run


async def refresh(store: EvalStore, jobs: JobRecords, run: EvalRun) -> EvalRun:
    """The run as its job stands now; one that just ended stored with its summary (read once). Written with
    compare-and-set: a run another writer ended (the follower, a cancel) stays as that writer left it."""
    if run.state in ENDED:
        return run
    found = await jobs.find(run.job)
    if found is None or found.status is None:
        return run
    status = found.status
    state = STATE_OF_JOB.get(status.state, "in_progress")
    if state == run.state:
        return run
    changes: dict = {"state": state, "message": status.message}
    if state == "completed":
        ref = next((a for a in status.artifacts if a.kind == "eval"), None)
        if ref is None:
            changes = {"state": "failed", "message": "the run stored no results"}
        else:
            done = msgspec.structs.replace(run, results=ref.name, sha256=ref.sha256)
            _, summary = await store.results(done)
            changes |= {"results": ref.name, "sha256": ref.sha256, "summary": summary}

    def change(current: EvalRun) -> EvalRun | None:
        if current.state in ENDED or current.state == changes["state"]:
            return None
        return msgspec.structs.replace(current, **changes, updated=time.time())

    return await store.update_run(run.tenant, run.id, change) or run


async def cancel(nc: Client, store: EvalStore, run: EvalRun) -> EvalRun:
    if run.state not in ("queued", "in_progress"):
        return run
    await bus.request(nc, names.jobs_api(run.tenant).cancel, JobQuery(run.job), JobReply | Error, ASK_TIMEOUT_S)

    def change(current: EvalRun) -> EvalRun | None:
        if current.state in ENDED:
            return None
        return msgspec.structs.replace(current, state="canceled", message="cancelled", updated=time.time())

    return await store.update_run(run.tenant, run.id, change) or run
