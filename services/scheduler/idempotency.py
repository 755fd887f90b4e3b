"""Idempotent submission: a key a client sends again gets the job its first submission made, not a second one."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from dataclasses import dataclass

import msgspec

from schemas.jobs import FieldError, JobId, JobRequest
from schemas.job_status import IdempotencyRecord
from schemas.validate import InvalidRequest
from services.scheduler.store import JobStore

_canonical = msgspec.json.Encoder(order="sorted")


def request_digest(request: JobRequest) -> str:
    return hashlib.sha256(_canonical.encode(request)).hexdigest()


@dataclass
class Claim:
    """The job a submission with an idempotency key is: already `stored`, or to be stored under `job`; with the
    sequence of its index entry once a try wrote it (`index_seq`: a job is entered in the index once)."""

    job: JobId
    stored: bool
    index_seq: int = 0


class IdempotencyKeys:
    """Claims keys in the jobs bucket (durable across restarts), one submission of a key at a time."""

    def __init__(self, store: JobStore, window_s: float) -> None:
        self.store, self.window_s = store, window_s
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # key -> its lock, and how many hold or wait for it

    @contextlib.asynccontextmanager
    async def turn(self, key: str):
        """One submission of `key` at a time. The lock is forgotten only when nobody holds or waits for it, so a
        request that comes while another waits queues behind it instead of getting a fresh lock."""
        lock, users = self._locks.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            _, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    async def claim(self, key: str, request: JobRequest, job_id: JobId, job_exists) -> Claim:
        """Which job the submission is: the key's first job, stored already (answer with it), or the id to store it
        under (`job_id`, or the id a first try reserved whose write had an unknown outcome: stored under the same
        id, a late landing of that write is this same job). Raises InvalidRequest when the key was used for a
        different request within the window. Call in turn(key)."""
        record = IdempotencyRecord(job=job_id, request_sha256=request_digest(request), created=time.time())
        while True:
            found = await self.store.idempotency(key)
            if found is None:
                if await self.store.write_idempotency(key, record, 0):
                    return Claim(job_id, stored=False)
                continue  # another scheduler wrote it first: read it
            earlier, revision = found
            fresh = record.created - earlier.created < self.window_s
            same = earlier.request_sha256 == record.request_sha256
            exists = fresh and await job_exists(earlier.job)
            if fresh and same:  # stored, or reserved by a try whose write may land yet (and its index entry)
                return Claim(earlier.job, stored=exists, index_seq=earlier.index_seq)
            if exists:
                raise InvalidRequest(
                    [
                        FieldError(
                            "idempotency_key",
                            (
                                f"was used for job {earlier.job}, a different request, {record.created - earlier.created:.0f}s ago; "
                                "use a new key for a new job"
                            ),
                        )
                    ]
                )
            # expired, or its job was never stored (a crash between the two writes): the key is free again
            if await self.store.write_idempotency(key, record, revision):
                return Claim(job_id, stored=False)

    async def note_index(self, key: str, claim: Claim) -> None:
        """A try whose write had an unknown outcome wrote the job's index entry: the key's record keeps its
        sequence, so that a retry, however late within the window, enters the job in the index no second time."""
        found = await self.store.idempotency(key)
        if found is None or found[0].job != claim.job or found[0].index_seq == claim.index_seq:
            return
        record = msgspec.structs.replace(found[0], index_seq=claim.index_seq)
        await self.store.write_idempotency(key, record, found[1])  # lost to a newer write: that one holds

    async def release(self, key: str) -> None:
        """The job could not be stored: its key must not point at it."""
        await self.store.forget_idempotency(key)
