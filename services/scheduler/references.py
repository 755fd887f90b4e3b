"""What a job names that other services keep (datasets, the registry's adapters): checked and pinned at submit,
so the job trains on what it was submitted with. A tenant sees only its own and what an admin shared with it."""

from __future__ import annotations

import msgspec

from schemas.jobs import FieldError, JobRequest
from services.artifacts.datasets import visible_dataset
from services.scheduler.core import SchedulerCore


def method_mismatch(name: str, fmt: str, method: str) -> str:
    """Why a dataset of format `fmt` does not fit the job's train.method."""
    if method == "dpo":
        return f"dataset {name} holds {fmt} rows; dpo trains on preference pairs: name a preference dataset"
    return (
        f"dataset {name} holds preference pairs, which train.method 'dpo' trains on; set train.method to dpo, "
        "or name a dataset of answers"
    )


async def ownership_errors(core: SchedulerCore, req: JobRequest, tenant: str | None) -> list[FieldError]:
    """A tenant registers only under an adapter name that is free or already its own."""
    if req.register is None or tenant is None:
        return []
    try:
        alias, _ = await core.adapters.alias(req.register.name)
    except Exception as e:
        return [
            FieldError(
                "register.name",
                f"the adapter registry could not be read ({type(e).__name__}); nothing was queued: submit again",
            )
        ]
    if alias is not None and alias.tenant != tenant:
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
            if (found.stats.format == "preference") != (req.train.method == "dpo"):
                errors.append(
                    FieldError(f"{where}.name", method_mismatch(ref.name, found.stats.format, req.train.method))
                )
    return msgspec.structs.replace(req, **pinned), errors


async def pin_init_adapter(
    core: SchedulerCore, req: JobRequest, tenant: str | None
) -> tuple[JobRequest, list[FieldError]]:
    """The request with init_adapter pinned to a version and its PEFT archive; or why it cannot start there.
    Another tenant's adapter is 'no adapter' to a tenant."""
    ref = req.init_adapter
    assert ref is not None
    alias, _ = await core.adapters.alias(ref.name)
    if alias is None or (tenant is not None and alias.tenant != tenant):
        return req, [
            FieldError("init_adapter.name", f"no adapter named {ref.name} of yours; `jetlora adapters ls` lists them")
        ]
    number = ref.version or alias.current
    version = await core.adapters.version(ref.name, number) if number else None
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
