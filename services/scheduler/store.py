"""The jobs KV bucket: requests written once, statuses updated with compare-and-set."""

from __future__ import annotations

import asyncio

import msgspec
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from schemas.jobs import JobStatus, StoredRequest

_enc = msgspec.json.Encoder()
_dec_req = msgspec.json.Decoder(StoredRequest)
_dec_status = msgspec.json.Decoder(JobStatus)


class Conflict(Exception):
    """Someone else (another scheduler) wrote the job's status first."""


def request_key(job: str) -> str:
    return f"request.{job}"


def status_key(job: str) -> str:
    return f"status.{job}"


class JobStore:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def add(self, stored: StoredRequest) -> None:
        """Store a new job durably; raises if the id exists."""
        await self.kv.create(request_key(stored.id), _enc.encode(stored))

    async def request(self, job: str) -> StoredRequest:
        entry = await self.kv.get(request_key(job))
        return _dec_req.decode(entry.value)

    async def write_status(self, job: str, status: JobStatus, revision: int) -> int:
        """Write the status if nobody wrote it since `revision` (0: never written); the new revision."""
        try:
            if revision == 0:
                return await self.kv.create(status_key(job), _enc.encode(status))
            return await self.kv.update(status_key(job), _enc.encode(status), last=revision)
        except KeyWrongLastSequenceError as e:
            raise Conflict(f"job {job}: its status changed elsewhere ({e.description})") from None

    async def load(self) -> tuple[dict[str, StoredRequest], dict[str, tuple[JobStatus, int]]]:
        """Every job and status in the bucket, read in one pass over its stream (fast for many jobs)."""
        requests: dict[str, StoredRequest] = {}
        statuses: dict[str, tuple[JobStatus, int]] = {}
        try:
            watcher = await self.kv.watchall(ignore_deletes=True)
        except NotFoundError:
            return requests, statuses
        async for entry in watcher:
            if entry is None:  # the initial values are all delivered
                break
            kind, _, job = entry.key.partition(".")
            if kind == "request":
                stored = _dec_req.decode(entry.value)
                requests[job] = msgspec.structs.replace(stored, request=msgspec.structs.replace(stored.request, data=[]))
            elif kind == "status":
                statuses[job] = (_dec_status.decode(entry.value), entry.revision)
        await asyncio.shield(watcher.stop())
        return requests, statuses
