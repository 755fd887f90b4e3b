"""The jobs KV bucket: requests written once, statuses updated with compare-and-set."""

from __future__ import annotations

import asyncio
import hashlib

import msgspec
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from schemas import names
from schemas.jobs import IdempotencyRecord, JobId, JobStatus, StoredRequest

_enc = msgspec.json.Encoder()
_dec_req = msgspec.json.Decoder(StoredRequest)
_dec_status = msgspec.json.Decoder(JobStatus)
_dec_idem = msgspec.json.Decoder(IdempotencyRecord)
REQUEST, STATUS, IDEMPOTENCY = "request", "status", "idem"
JOBS = names.kv(names.JOBS_KV)


class Conflict(Exception):
    """Someone else (another scheduler) wrote the job's status first."""


class LoadError(Exception):
    """The bucket could not be read whole: never taken for an empty one."""


def request_key(job: JobId) -> str:
    return f"{REQUEST}.{job}"


def status_key(job: JobId) -> str:
    return f"{STATUS}.{job}"


def idempotency_key(client_key: str) -> str:
    """A client's key may hold any text; the bucket's key is its digest."""
    return f"{IDEMPOTENCY}.{hashlib.sha256(client_key.encode()).hexdigest()}"


class JobStore:
    """Every read and write of a job's keys goes through here."""

    def __init__(self, js, kv: KeyValue) -> None:
        self.js, self.kv = js, kv

    async def add(self, stored: StoredRequest) -> None:
        """Store a new job durably; raises if the id exists."""
        await self.kv.create(request_key(stored.id), _enc.encode(stored))

    async def request(self, job: JobId) -> StoredRequest:
        entry = await self.kv.get(request_key(job))
        return _dec_req.decode(entry.value)

    async def find(self, job: JobId) -> tuple[StoredRequest, JobStatus | None, int] | None:
        """A job's request (without its data, as the scheduler holds it), status and status revision; None only
        when the bucket has no such job."""
        try:
            stored = _without_data(await self.request(job))
        except KeyNotFoundError:
            return None
        status = await self.status(job)
        return (stored, *status) if status else (stored, None, 0)

    async def _read(self, key: str, decoder: msgspec.json.Decoder):
        """The value under `key` and its revision; None when there is none."""
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        return decoder.decode(entry.value), entry.revision

    async def status(self, job: JobId) -> tuple[JobStatus, int] | None:
        return await self._read(status_key(job), _dec_status)

    async def _write_if_unchanged(self, key: str, value, revision: int) -> int:
        """Write if nobody wrote the key since `revision` (0: never written); the new revision, or Conflict."""
        try:
            if revision == 0:
                return await self.kv.create(key, _enc.encode(value))
            return await self.kv.update(key, _enc.encode(value), last=revision)
        except KeyWrongLastSequenceError as e:
            raise Conflict(e.description) from None

    async def write_status(self, job: JobId, status: JobStatus, revision: int) -> int:
        """Write the status if nobody wrote it since `revision` (0: never written); the new revision."""
        try:
            return await self._write_if_unchanged(status_key(job), status, revision)
        except Conflict as e:
            raise Conflict(f"job {job}: its status changed elsewhere ({e})") from None

    async def idempotency(self, client_key: str) -> tuple[IdempotencyRecord, int] | None:
        return await self._read(idempotency_key(client_key), _dec_idem)

    async def write_idempotency(self, client_key: str, record: IdempotencyRecord, revision: int) -> bool:
        """Write if nobody wrote it since `revision` (0: never); False when someone did."""
        try:
            await self._write_if_unchanged(idempotency_key(client_key), record, revision)
            return True
        except Conflict:
            return False

    async def forget_idempotency(self, client_key: str) -> None:
        await self.kv.delete(idempotency_key(client_key))

    async def load(self, timeout: float = 60.0) -> tuple[dict[str, StoredRequest], dict[str, tuple[JobStatus, int]]]:
        """Every job and status in the bucket, read in one pass over its stream.

        The stream's own message count says how much there is, and each delivery says how much is left, so
        an error or a server still restoring the stream raises LoadError instead of reading as 'no jobs'."""
        requests: dict[str, StoredRequest] = {}
        statuses: dict[str, tuple[JobStatus, int]] = {}
        try:
            info = await self.js.stream_info(JOBS.stream)
        except Exception as e:
            raise LoadError(f"the jobs bucket could not be read ({type(e).__name__}: {e})") from e
        if info.state.messages == 0:
            return requests, statuses
        sub = await self.js.subscribe(JOBS.subjects, ordered_consumer=True,
                                      deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=timeout)
                except Exception as e:
                    raise LoadError(f"the jobs bucket stopped delivering after {len(requests)} jobs "
                                    f"({type(e).__name__}); nothing was concluded from it") from e
                op = (msg.headers or {}).get(KV_OP)
                if op not in (KV_DEL, KV_PURGE):
                    kind, _, job = msg.subject.removeprefix(JOBS.prefix).partition(".")
                    if kind == REQUEST:
                        requests[job] = _without_data(_dec_req.decode(msg.data))
                    elif kind == STATUS:
                        statuses[job] = (_dec_status.decode(msg.data), msg.metadata.sequence.stream)
                if msg.metadata.num_pending == 0:
                    return requests, statuses
        finally:
            await asyncio.shield(sub.unsubscribe())


def _without_data(stored: StoredRequest) -> StoredRequest:
    """The scheduler keeps requests without their training data: it reads the data only to assign a job."""
    return msgspec.structs.replace(stored, request=msgspec.structs.replace(stored.request, data=[]))
