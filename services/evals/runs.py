"""An eval run placed as a job (train.method eval) on the tenant's own submit subject, or through the engine that
serves its name (engine_path.py), and its record kept up with the job's: read through the jobs bucket's stored
format (services/job_records.py), so a run's state answers while the scheduler is between leaders. A run that ended
is finished once, by the follower (follow.py) as its job ends or on the first read after, whichever comes first
(compare-and-set): its summary is read from its `eval` artifact and stored with the run, so results stay per adapter
version."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client

from schemas import names
from schemas.engine_evals import TRAINER, EngineEvalRequest, engine_via
from schemas.evals import EvalDef, EvalJob, EvalRun, RunRequest, RunState
from schemas.jobs import Error, Rejected, SubmitReply, Unsure
from schemas.job_status import JobQuery, JobReply
from schemas.registry import AdapterQuery, AdapterReply
from services import bus
from services.evals import engine_path
from services.evals.engine_path import ENDED, EngineRuns
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
FIELDS = {"dataset.name": "dataset", "init_adapter.name": "adapter", "init_adapter.version": "version"}


class RunError(Exception):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class Target:
    """What a run grades: a base model, or a registered version of the tenant's (with the registry's answer about its
    name: its alias and where its engines loaded it)."""

    base_model: str
    adapter: str | None = None
    version: int | None = None
    found: AdapterReply | None = None


async def target(nc: Client, q: RunRequest, tenant: str | None) -> Target:
    """What the run grades: a registered version of the tenant's (none given: what its name serves now) or a base
    model."""
    if (q.adapter is None) == (q.base_model is None):
        raise RunError("name what to grade: an adapter (NAME[@V]) or a base model, one of them", "adapter")
    if q.adapter is None:
        assert q.base_model is not None
        return Target(q.base_model)
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
    return Target(found.base_model, q.adapter, found.version, reply)


async def place(
    nc: Client, store: EvalStore, engines: EngineRuns, e: EvalDef, q: RunRequest, tenant: str | None
) -> EvalRun:
    """Store the run and start it: through an engine that serves the name where engine_path.route() finds one, else
    as a job on the tenant's submit subject (the scheduler checks it as any of the tenant's jobs). RunError names
    the field at fault."""
    t = await target(nc, q, tenant)
    run = draft(e, q, tenant, t)
    way = engine_path.route(q, t.adapter, t.version, t.found)
    if not way.nodes:
        if q.via == "engine":
            raise RunError(f"--via engine: {way.note}", "via")
        run = msgspec.structs.replace(run, job=await submit_job(nc, run, e, q), via_note=way.note)
        await store.put_run(run)
        return run
    ref = await engine_path.pinned(nc.jetstream(), run.dataset, tenant)
    if isinstance(ref, str):
        raise RunError(ref, "dataset")
    assert run.adapter is not None and run.version is not None
    ask = EngineEvalRequest(
        run=run.id, eval=e.name, adapter=run.adapter, version=run.version, dataset=ref, criteria=e.criteria,
        sampling=run.sampling or e.sampling,
    )  # fmt: skip
    first = way.nodes[0]
    run = msgspec.structs.replace(run, state="in_progress", via=engine_via(first.engine, first.node), via_note=way.note)
    await store.put_run(run)

    async def fallback(r: EvalRun, why: str) -> None:
        await to_trainer(nc, store, r, e, q, why)

    engines.start(run, ask, way.nodes, None if q.via == "engine" else fallback)
    return run


def draft(e: EvalDef, q: RunRequest, tenant: str | None, t: Target) -> EvalRun:
    """The run's record before it is placed (no job, no path yet)."""
    dataset = q.dataset or e.dataset
    if dataset is None:
        raise RunError(f"eval {e.name} names no dataset: give the run one (its items, an rft dataset)", "dataset")
    now = time.time()
    return EvalRun(
        id=f"evalrun_{secrets.token_hex(8)}",
        eval=e.name,
        tenant=tenant,
        job="",
        base_model=t.base_model,
        adapter=t.adapter,
        version=t.version,
        dataset=dataset,
        created=now,
        updated=now,
        name=q.name or f"{e.name} on {f'{t.adapter}@{t.version}' if t.adapter else t.base_model}",
        metadata=q.metadata,
        source=q.source,
        sampling=q.sampling or e.sampling,
    )


async def submit_job(nc: Client, run: EvalRun, e: EvalDef, q: RunRequest) -> str:
    """The run's job (train.method eval) submitted on the tenant's subject: its id; RunError where refused."""
    request = {
        "model": run.base_model,
        "base_dir": q.base_dir,
        "accelerator": q.accelerator,
        "dataset": {"name": run.dataset},
        "train": {"method": "eval"},
        "evaluate": EvalJob(eval=e.name, run=run.id, criteria=e.criteria, sampling=run.sampling or e.sampling),
        "label": f"eval {e.name} run {run.id}",
    }
    if run.adapter is not None:
        request["init_adapter"] = {"name": run.adapter, "version": run.version}
    request["idempotency_key"] = f"eval-run-{run.tenant or ''}-{run.id}"  # asked again: the same job, never two
    for pause in (0.5, 1.0, 2.0, None):
        reply = await bus.request(nc, names.jobs_api(run.tenant).submit, request, SubmitReply, ASK_TIMEOUT_S)
        if not isinstance(reply, Unsure) or pause is None:
            break
        await asyncio.sleep(pause)  # the store did not say whether it was stored: the same key tells
    if isinstance(reply, Unsure):
        raise RunError(f"the job store did not answer whether the run's job {reply.job} was stored; run it again", "")
    if isinstance(reply, Rejected):
        first = reply.errors[0]
        raise RunError(
            f"the run's job was refused: {first.field}: {first.reason}", FIELDS.get(first.field, first.field)
        )
    return reply.job


async def to_trainer(nc: Client, store: EvalStore, run: EvalRun, e: EvalDef, q: RunRequest, why: str) -> None:
    """An engine run that no engine sampled, placed as a job after all (auto), saying why; one that ended meanwhile
    (cancelled) stays as it is."""
    current = await store.run(run.tenant, run.id)
    if current is None or current.state in ENDED:
        return
    note = f"{why}; sampled by the trainer instead"
    try:
        job = await submit_job(nc, current, e, q)
    except (RunError, bus.RequestError) as err:
        changes = {"state": "failed", "message": f"{why}; and through the trainer: {err}", "via": TRAINER}
    else:
        changes = {"state": "queued", "message": "", "job": job, "via": TRAINER}

    def change(now: EvalRun) -> EvalRun | None:
        if now.state in ENDED:
            return None
        return msgspec.structs.replace(now, **changes, via_note=note, updated=time.time())

    stored = await store.update_run(run.tenant, run.id, change)
    if "job" in changes and (stored is None or stored.job != changes["job"]):  # cancelled or deleted meanwhile
        cancel = names.jobs_api(run.tenant).cancel
        await bus.request(nc, cancel, JobQuery(changes["job"]), JobReply | Error, ASK_TIMEOUT_S)


async def refresh(store: EvalStore, jobs: JobRecords, run: EvalRun) -> EvalRun:
    """The run as its job stands now; one that just ended stored with its summary (read once). Written with
    compare-and-set: a run another writer ended (the follower, a cancel) stays as that writer left it."""
    if run.state in ENDED:
        return run
    if not run.job:  # sampled through an engine: its asker finishes it (engine_path.py)
        return await engine_path.expire(store, run)
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
    if run.job:  # (an engine run's asker is cancelled by the service: EngineRuns.cancel)
        await bus.request(nc, names.jobs_api(run.tenant).cancel, JobQuery(run.job), JobReply | Error, ASK_TIMEOUT_S)

    def change(current: EvalRun) -> EvalRun | None:
        if current.state in ENDED:
            return None
        return msgspec.structs.replace(current, state="canceled", message="cancelled", updated=time.time())

    return await store.update_run(run.tenant, run.id, change) or run
