"""What a job names that other services keep (datasets, the registry's adapters): checked and pinned at submit,
so the job trains on what it was submitted with (datasets read through the bucket's stored format, adapters asked
of the registry over NATS). A tenant sees only its own and what an admin shared with it. And the other way round:
which unfinished jobs name a dataset (the artifact service asks before a delete)."""

from __future__ import annotations

import contextlib

import msgspec

from schemas import names
from schemas.datasets import PinnedJob, Pinning, PinningQuery
from schemas.jobs import FieldError, JobRequest
from schemas.job_status import TERMINAL_STATES
from services.scheduler import registry_asks
from services.scheduler.core import SchedulerCore
from services.scheduler.registry_asks import RegistryUnanswered
from services.transfer.datasets import visible_dataset


async def pinning(core: SchedulerCore, q: PinningQuery) -> Pinning:
    """The unfinished jobs whose dataset or validation_dataset is the one stored under q.dataset, from memory (the
    leader holds every unfinished job, without its data), and the submissions that pinned it and are being stored:
    their count, and the first q.limit jobs by id."""
    found = sorted(
        (job.id, job.status.state)
        for job in core.jobs.values()
        if job.status.state not in TERMINAL_STATES and q.dataset in _datasets_named(job.stored.request)
    )
    count = len(found) + core.pins_in_flight[q.dataset]
    return Pinning(count=count, jobs=[PinnedJob(job=job, state=state) for job, state in found[: q.limit]])


@contextlib.contextmanager
def pinned_in_flight(core: SchedulerCore, req: JobRequest):
    """While a submission that pinned datasets is being stored, `pinning` counts it: a delete asked meanwhile is
    refused as for a job in memory."""
    named = _datasets_named(req)
    if not named:  # most jobs name no stored dataset: nothing to count in and out
        yield
        return
    core.pins_in_flight.update(named)
    try:
        yield
    finally:
        core.pins_in_flight.subtract(named)
        for name in named:
            if core.pins_in_flight[name] <= 0:
                del core.pins_in_flight[name]


async def datasets_gone(core: SchedulerCore, req: JobRequest, tenant: str | None) -> list[FieldError]:
    """After a job is stored: a pinned dataset that was deleted since it was pinned (a delete that had asked
    `pinning` just before the submission pinned it). Unread is taken as there: the job fails later if not."""
    errors = []
    for where in ("dataset", "validation_dataset"):
        if (ref := getattr(req, where)) is None:
            continue
        try:
            found = await visible_dataset(core.js, ref.name, tenant)
        except Exception:
            continue
        if found is None or (ref.sha256 and found.sha256 != ref.sha256):
            errors.append(
                FieldError(
                    f"{where}.name",
                    f"dataset {ref.name} was deleted or replaced while the job was being submitted; upload it again "
                    "and submit again",
                )
            )
    return errors


def _datasets_named(req: JobRequest) -> set[str]:
    """The object names of the datasets a request names (as pinned at submit)."""
    refs = (req.dataset, req.validation_dataset)
    return {names.dataset_object(r.name, r.owner) for r in refs if r is not None}


METHOD_OF_FORMAT = {"preference": "dpo", "rft": "grpo"}  # every other format holds answers, which sft learns
TRAINS_ON = {"dpo": "preference pairs", "grpo": "rft prompts", "sft": "answers"}


def method_mismatch(name: str, fmt: str, method: str) -> str | None:
    """Why a dataset of format `fmt` does not fit the job's train.method; None when it does."""
    if fmt == "evals":  # OpenAI's {"item", "sample"} rows: graded by the Evals API, trained on by nothing
        return f"dataset {name} holds evals rows (items and samples for the Evals API); no job trains on them"
    wanted = METHOD_OF_FORMAT.get(fmt, "sft")
    if wanted == method or (method == "eval" and fmt == "rft"):
        return None
    if method == "eval":
        return f"dataset {name} holds {fmt} rows; an eval's items are rft rows (messages ending in a user turn)"
    if method == "dpo":
        return f"dataset {name} holds {fmt} rows; dpo trains on preference pairs: name a preference dataset"
    if method == "grpo":
        return f"dataset {name} holds {fmt} rows; grpo trains on prompts to answer: name an rft dataset"
    return (
        f"dataset {name} holds {TRAINS_ON[wanted]}, which train.method '{wanted}' trains on; set train.method to "
        f"{wanted}, or name a dataset of answers"
    )


async def ownership_errors(core: SchedulerCore, req: JobRequest, tenant: str | None) -> list[FieldError]:
    """A tenant registers only under an adapter name that is free or already its own (the registry is asked)."""
    if req.register is None or tenant is None:
        return []
    try:
        found = await registry_asks.adapter(core.nc, req.register.name)
    except RegistryUnanswered as e:
        return [FieldError("register.name", f"{e}; nothing was queued: submit again once it answers")]
    if found is not None and found.alias.tenant != tenant:
        return [
            FieldError(
                "register.name", f"the adapter name {req.register.name} belongs to another tenant; choose another name"
            )
        ]
    return []


async def pin_datasets(core: SchedulerCore, req: JobRequest, tenant: str | None) -> tuple[JobRequest, list[FieldError]]:
    """The request with each named dataset pinned to the content it has now; or why a name or pin is wrong.
    A tenant sees only the datasets an admin shared with it: another's is 'no dataset' to it."""
    errors, pinned = [], {}
    for where in ("dataset", "validation_dataset"):
        if (ref := getattr(req, where)) is None:
            continue
        try:
            found = await visible_dataset(core.js, ref.name, tenant)
        except Exception as e:
            errors.append(
                FieldError(
                    where,
                    f"the datasets bucket could not be read ({type(e).__name__}); nothing was queued: submit again",
                )
            )
            continue
        if found is None:
            fix = (
                f"an admin shares one with `jetlora datasets put FILE --name {ref.name} --share {tenant}`"
                if tenant is not None
                else f"`jetlora datasets ls` lists them, `jetlora datasets put FILE --name {ref.name}` adds one"
            )
            errors.append(FieldError(f"{where}.name", f"no dataset named {ref.name}; {fix}"))
        elif ref.sha256 and ref.sha256 != found.sha256:
            errors.append(
                FieldError(
                    f"{where}.sha256",
                    f"dataset {ref.name} now holds sha256 {found.sha256}, not "
                    f"the pinned {ref.sha256} (it was replaced); pin the new one, "
                    "or upload the old file under another name",
                )
            )
        else:
            pinned[where] = msgspec.structs.replace(ref, sha256=found.sha256, owner=found.owner)
            fraction = req.train.eval_fraction
            if where == "dataset" and fraction and found.stats.rows * fraction < 1:
                errors.append(
                    FieldError(
                        "train.eval_fraction",
                        f"{fraction} of {found.stats.rows} rows holds out none; raise it or name a validation_dataset",
                    )
                )
            if mismatch := method_mismatch(ref.name, found.stats.format, req.train.method):
                errors.append(FieldError(f"{where}.name", mismatch))
    return msgspec.structs.replace(req, **pinned), errors


async def pin_init_adapter(
    core: SchedulerCore, req: JobRequest, tenant: str | None
) -> tuple[JobRequest, list[FieldError]]:
    """The request with init_adapter pinned to a version and its PEFT archive; or why it cannot start there.
    Another tenant's adapter is 'no adapter' to a tenant."""
    ref = req.init_adapter
    assert ref is not None
    try:
        found = await registry_asks.adapter(core.nc, ref.name)
    except RegistryUnanswered as e:
        return req, [FieldError("init_adapter.name", f"{e}; nothing was queued: submit again once it answers")]
    if found is None or (tenant is not None and found.alias.tenant != tenant):
        return req, [
            FieldError("init_adapter.name", f"no adapter named {ref.name} of yours; `jetlora adapters ls` lists them")
        ]
    number = ref.version or found.alias.current
    version = next((v for v in found.versions if v.version == number), None) if number else None
    if version is None:
        return req, [
            FieldError(
                "init_adapter.version",
                f"{ref.name} has no version {number}"
                if number
                else f"{ref.name} serves no version now (retired); name one with init_adapter.version",
            )
        ]
    if version.base_model != req.model:
        return req, [
            FieldError(
                "init_adapter.name",
                f"{ref.name}@{version.version} was trained on {version.base_model}, not this job's model {req.model}",
            )
        ]
    pinned = msgspec.structs.replace(ref, version=version.version, peft=version.peft.name)
    return msgspec.structs.replace(req, init_adapter=pinned), []


async def pin_session_start(
    core: SchedulerCore, req: JobRequest, tenant: str | None
) -> tuple[JobRequest, list[FieldError]]:
    """A session that starts from another session's saved state: that job must be a session of the same tenant
    with a checkpoint stored at that step; the request gets the checkpoint's object name (another tenant's job is
    'no such session' to it)."""
    session = req.session
    start = session.start_from if session is not None else None
    if session is None or start is None:
        return req, []
    try:
        source = await core.lookup(start.job)
    except Exception as e:
        return req, [FieldError("session.start_from.job", f"the jobs bucket could not be read ({e}); submit again")]
    if source is None or source.stored.tenant != tenant or source.stored.request.session is None:
        return req, [FieldError("session.start_from.job", f"no session job {start.job} of yours")]
    was = source.stored.request
    assert was.session is not None
    if (was.base_dir, was.session.rank, was.session.target_modules()) != (
        req.base_dir,
        session.rank,
        session.target_modules(),
    ):
        return req, [
            FieldError(
                "session.start_from.job",
                f"session {start.job} trained rank {was.session.rank} on {was.session.target_modules()} of "
                f"{was.base_dir}: start from it with the same base_dir, rank and train_attn/train_mlp/train_unembed",
            )
        ]
    stored = source.status.checkpoint  # the latest: every session checkpoint carries all its saves
    if stored is None or not any(c.step == start.step for c in source.status.checkpoints):
        return req, [
            FieldError("session.start_from.step", f"session {start.job} stored no state at step {start.step} yet")
        ]
    pinned = msgspec.structs.replace(start, checkpoint=stored)
    return msgspec.structs.replace(req, session=msgspec.structs.replace(session, start_from=pinned)), []
