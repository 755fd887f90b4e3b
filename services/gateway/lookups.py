"""What the gateway asks the services about one object of a tenant, over NATS: a job, a file (a dataset), a
fine-tuned model (a registered adapter). Anything that is not the tenant's is a 404, as if it did not exist."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

from schemas import names
from schemas.datasets import DatasetInfo, DatasetQuery, DatasetReply
from schemas.jobs import Error
from schemas.job_status import JobQuery, JobReply, JobSummary
from schemas.registry import AdapterQuery, AdapterReply, AdapterVersion
from services import bus
from services.gateway.errors import OpenAIError, is_token, not_found

T = TypeVar("T")
AT_ONCE = 8  # requests one API request makes to the services at once (a tenant's turns there are bounded)


def unanswered(reply: Error) -> OpenAIError:
    """A service's refusal that is not about the object asked for (it is busy, or failed): ours, a 503."""
    return OpenAIError(503, reply.error, None, "service_unavailable", "server_error")


async def gather_bounded(asks: Iterable[Awaitable[T]], at_once: int = AT_ONCE) -> list[T]:
    """Every ask's answer, in order, at most `at_once` of them in flight."""
    turns = asyncio.Semaphore(at_once)

    async def one(ask: Awaitable[T]) -> T:
        async with turns:
            return await ask

    return await asyncio.gather(*(one(a) for a in asks))


async def job_summary(nc, tenant: str, job: str) -> JobSummary:
    found = await job_summary_or_none(nc, tenant, job)
    if found is None:
        raise not_found("fine-tuning job", job)
    return found


async def job_summary_or_none(nc, tenant: str, job: str) -> JobSummary | None:
    if not is_token(job):
        return None
    reply = await bus.request(nc, names.jobs_api(tenant).job, JobQuery(job), JobReply | Error)
    if isinstance(reply, Error):
        if reply.field != "job":
            raise unanswered(reply)
        return None  # not there, or another tenant's
    return reply.job


async def dataset_info(nc, tenant: str, ident: str, param: str | None = None) -> DatasetInfo:
    reply = (
        await bus.request(nc, names.datasets_api(tenant).show, DatasetQuery(name=ident), DatasetReply | Error)
        if is_token(ident)
        else None
    )
    if not isinstance(reply, DatasetReply):
        raise not_found("file", ident, param)
    return reply.dataset


def served_version(reply: AdapterReply, tenant: str) -> AdapterVersion | None:
    """The version a tenant's fine-tuned model serves now; None when it is another's, an admin's or retired."""
    alias = reply.alias
    if alias.tenant != tenant or alias.retired or alias.current is None:
        return None
    return next((v for v in reply.versions if v.version == alias.current), None)


async def fine_tuned_model(nc, tenant: str, name: str) -> tuple[AdapterReply, AdapterVersion] | None:
    """The tenant's fine-tuned model `name` (a registered adapter that serves a version), or None."""
    if not is_token(name):
        return None
    reply = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name=name), AdapterReply | Error)
    if isinstance(reply, Error) or (version := served_version(reply, tenant)) is None:
        return None
    return reply, version
