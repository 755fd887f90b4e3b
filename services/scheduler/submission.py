"""Taking a job in: checks, the tenant's queued quota, the idempotency key, and the write that makes it durable,
answered only with what is known: accepted (stored), rejected (nothing stored), or unsure (a write whose outcome
is unknown; the job id it reserved, and a retry with the same key is that job, never a second one)."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable

import msgspec

from schemas.job_checks import parse_job_request
from schemas.jobs import Accepted, FieldError, JobRequest, Rejected, Unsure
from schemas.job_status import JobStatus, StoredRequest
from services import bus, graders
from services.scheduler import references, sizing
from services.scheduler.submission_checks import capacity_errors, held_mib, quota_errors
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.fence import Deposed
from services.scheduler.idempotency import Claim, IdempotencyKeys

log = logging.getLogger(__name__)
READ_BACK_S = 2.0  # a submission whose write went unanswered reads it back this long at most before answering


class Submissions:
    """The submit endpoint's work: one submission from its parsed request to its answer."""

    def __init__(self, core: SchedulerCore, idempotency: IdempotencyKeys) -> None:
        self.core, self.idempotency = core, idempotency
        self._admitting: Counter[str | None] = Counter()  # submissions being checked and stored, by tenant

    @staticmethod
    def parse_with_size(data: bytes) -> tuple[JobRequest, int]:
        return parse_job_request(data, graders.check), len(data)  # a grpo job's grader is checked whole here

    async def accept(self, parsed: tuple[JobRequest, int], subject: str) -> Accepted | Rejected | Unsure:
        request, size = parsed
        tenant = bus.tenant_of(subject)  # a reserved token (`_`: the admins') is refused here, storing nothing
        if request.idempotency_key is None:
            return await self._admit(request, size, tenant)
        key = f"{tenant or ''}/{request.idempotency_key}"  # one tenant's keys are not another's
        async with self.idempotency.turn(key):  # a retry waits for the first try's answer
            claim = await self.idempotency.claim(key, request, new_job_id(), self._job_exists)
            if claim.stored:
                return Accepted(claim.job)  # the same submission again: nothing new is stored
            entered = claim.index_seq
            reply = await self._admit(request, size, tenant, claim)  # a retry is answered before any quota
            if isinstance(reply, Rejected):
                await self.idempotency.release(key)
            elif isinstance(reply, Unsure) and claim.index_seq != entered:
                await self._note_index(key, claim)
            return reply  # Unsure keeps the key: a retry is this job, whether its write landed or not

    async def _note_index(self, key: str, claim: Claim) -> None:
        try:
            await self.idempotency.note_index(key, claim)
        except Exception as e:  # the store away: the index stream's duplicate window still keeps a retry's out
            log.warning("job %s: could not note its index entry under its idempotency key (%s)", claim.job, _why(e))

    async def _admit(
        self, request: JobRequest, size: int, tenant: str | None, claim: Claim | None = None
    ) -> Accepted | Rejected | Unsure:
        """Check, then store. A submission counts against its tenant's queued quota from the moment it passes the
        count (checked and counted with nothing awaited between), so concurrent ones cannot all pass it before any
        is stored, and none waits for another's turn."""
        ceiling = self.core.cfg.quota(tenant).priority_errors(tenant, request.priority)  # refused, not clamped
        if errors := ceiling + capacity_errors(self.core, request) + quota_errors(self.core, tenant, self._admitting):
            return Rejected(errors)
        self._admitting[tenant] += 1
        try:
            request, errors = sizing.size(self.core.fleet, request, functools.partial(held_mib, self.core))
            if errors:
                return Rejected(errors)
            errors = await references.ownership_errors(self.core, request, tenant)
            if errors:
                return Rejected(errors)
            request, errors = await references.pin_datasets(self.core, request, tenant)
            if not errors and request.init_adapter is not None:
                request, errors = await references.pin_init_adapter(self.core, request, tenant)
            if not errors and request.session is not None:
                request, errors = await references.pin_session_start(self.core, request, tenant)
            if errors:
                return Rejected(errors)
            with references.pinned_in_flight(self.core, request):
                reply = await self._store_new(request, size, tenant, claim)
                if isinstance(reply, Accepted) and (gone := await references.datasets_gone(self.core, request, tenant)):
                    return await self._fail_new(reply.job, gone)
            return reply
        finally:
            self._admitting[tenant] -= 1
            if not self._admitting[tenant]:
                del self._admitting[tenant]

    async def _job_exists(self, job_id: str) -> bool:
        return await self.core.lookup(job_id) is not None

    async def _store_new(
        self, request: JobRequest, size: int, tenant: str | None, claim: Claim | None = None
    ) -> Accepted | Rejected | Unsure:
        core = self.core
        core.seq += 1
        job_id = claim.job if claim else new_job_id()
        core.submitting.add(job_id)
        try:
            try:  # the index entry and the active mark first: a crash before the request leaves only what readers skip
                index_seq = await _both(self._index_entry(tenant, job_id, claim), core.store.mark_active(job_id))
            except Exception as e:  # the request was never written
                return Rejected(
                    [FieldError("", f"the job could not be stored ({_why(e)}); nothing was queued: submit it again")]
                )
            stored = StoredRequest(
                id=job_id, request=request, created=time.time(), seq=core.seq, tenant=tenant, index_seq=index_seq
            )
            try:
                await core.store.add(stored)  # durable before the reply: a crash after it loses nothing
            except Exception as e:
                if isinstance(e, Deposed) and not e.maybe_stored:
                    return Rejected(
                        [
                            FieldError(
                                "", f"the job could not be stored ({_why(e)}); nothing was queued: submit it again"
                            )
                        ]
                    )
                if await self._read_back(job_id) is not True:
                    return Unsure(
                        job_id,
                        f"the job's write was not answered ({_why(e)}); it may have been stored as {job_id}: `jetlora job {job_id}` tells once the store answers, and a retry with the same idempotency_key is this job, never a second one",
                    )
                if not core.may_act():
                    return Accepted(job_id)  # stored and marked active: the scheduler that leads next takes it up
        finally:
            core.submitting.discard(job_id)
        core.take_new(
            Job(
                msgspec.structs.replace(stored, request=msgspec.structs.replace(request, data=[])),
                JobStatus(updated=stored.created, message="waiting for a device"),
            ),
            request,
            size,
        )
        return Accepted(stored.id)

    async def _index_entry(self, tenant: str | None, job_id: str, claim: Claim | None) -> int:
        """The job's "submitted" entry in the index, written once per job id: a retry under the id an earlier try
        reserved (its outcome unknown) takes that try's entry, as the key's record or the stream's duplicate window
        knows it, instead of listing the job twice."""
        if claim is None:
            return await self.core.index.submitted(tenant, job_id)
        if not claim.index_seq:
            claim.index_seq = await self.core.index.submitted(tenant, job_id, once=True)
        return claim.index_seq

    async def _fail_new(self, job_id: str, errors: list[FieldError]) -> Rejected:
        """A job stored a moment ago whose dataset went meanwhile: it ends at once, failed, and is refused."""
        job = self.core.jobs.get(job_id)
        if job is not None:
            why = errors[0].reason
            try:
                await self.core.set_state(job, "failed", why, when=lambda s: s.state == "queued")
            except Exception as e:  # deposed or the store away: the job fails when it is placed and finds no data
                log.warning("job %s: could not record that its dataset went (%s)", job_id, e)
        return Rejected([*errors, FieldError("", f"job {job_id} was recorded as failed; nothing will run")])

    async def _read_back(self, job_id: str) -> bool | None:
        """After a write of unknown outcome: whether the job's request is in the store (None: the store does not
        answer either). Not finding it does not prove it will never land: the write may still be on its way."""
        try:
            return await asyncio.wait_for(self.core.store.find(job_id), READ_BACK_S) is not None
        except Exception as e:
            log.warning("job %s: could not read back its request (%s)", job_id, _why(e))
            return None


async def _both(first: Awaitable[int], second: Awaitable[None]) -> int:
    """Await both at once, the second in a task of its own (what asyncio.gather does with two, at one task and no
    gathering future less a submission); the first's result, or what either raised once both are done."""
    other = asyncio.ensure_future(second)
    try:
        result = await first
    except BaseException:
        await asyncio.wait([other])
        if not other.cancelled():
            other.exception()  # retrieved: the first's error is the one raised
        raise
    await other
    return result


def new_job_id() -> str:
    """16 hex digits from the system's random source (uuid4's text cost more than the rest of an id's making)."""
    return secrets.token_hex(8)


def _why(e: Exception) -> str:
    if isinstance(e, Deposed):
        return f"Deposed: this scheduler no longer leads: {e}"
    return f"{type(e).__name__}: JetStream unavailable? {e}"
