"""The jobs KV bucket's writer: requests written once, statuses written under the leader's fence, and the set of
active jobs. Its keys and values are a stored format (schemas/job_records.py) that other services read too."""

from __future__ import annotations

import asyncio

import msgspec
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from schemas.job_records import (
    ACTIVE,
    IDEMPOTENCY,
    JOBS,
    LAYOUT,
    REQUEST,
    STATUS,
    active_key,
    decode_request,
    decode_status,
    idempotency_key,
    kind_and_job,
    request_key,
    status_key,
    without_data,
)
from schemas.jobs import JobId
from schemas.job_status import IdempotencyRecord, JobStatus, StoredRequest
from services.jetstream_writer import JetStreamWriter, ViaJsPublish
from services.scheduler.fence import Fence

_enc = msgspec.json.Encoder()
_dec_idem = msgspec.json.Decoder(IdempotencyRecord)
PURGE_EXPIRING = {"KV-Operation": "PURGE", "Nats-Rollup": "sub", "Nats-TTL": "60s"}  # a purge that leaves nothing


class Conflict(Exception):
    """Someone else wrote the key first (the idempotency bucket's compare-and-set)."""


class LoadError(Exception):
    """The bucket could not be read whole: never taken for an empty one."""


class JobStore:
    """Every read and write of a job's keys goes through here. A leading scheduler's writes go through its
    term's fence (services/scheduler/fence.py): the store refuses them once another scheduler leads."""

    def __init__(
        self, js, kv: KeyValue, idempotency: KeyValue | None = None, writer: JetStreamWriter | None = None
    ) -> None:
        self.js, self.kv = js, kv
        self.idem = idempotency or kv  # its own bucket, whose max age is the idempotency window
        self.writer: JetStreamWriter | ViaJsPublish = writer or ViaJsPublish(js)
        self.fence: Fence | None = None  # none: a tool or test writing outside any term

    async def take_term(self, holder: str, leading) -> Fence:
        """Begin a term: from here on this store's writes are refused once a newer term begins."""
        self.fence = await Fence.take(self.writer, self.kv, JOBS.prefix, holder, leading)
        return self.fence

    async def _put(self, key: str, value: bytes) -> int:
        if self.fence is None:
            return await self.kv.put(key, value)
        return await self.fence.put(key, value)

    async def add(self, stored: StoredRequest) -> None:
        """Store a new job durably (its id is new: a random one). Marked active first (mark_active): an atomic
        batch of the two costs the server ten times their sum under load (nats-server 2.15: 337 submissions/s)."""
        await self._put(request_key(stored.id), _enc.encode(stored))

    async def request(self, job: JobId) -> StoredRequest:
        entry = await self.kv.get(request_key(job))
        return decode_request(entry.value or b"")

    async def find(self, job: JobId) -> tuple[StoredRequest, JobStatus | None, int] | None:
        """A job's request (without its data, as the scheduler holds it), status and status revision; None only
        when the bucket has no such job."""
        try:
            stored = without_data(await self.request(job))
        except KeyNotFoundError:
            return None
        status = await self.status(job)
        return (stored, *status) if status else (stored, None, 0)

    async def status(self, job: JobId) -> tuple[JobStatus, int] | None:
        return await _read(self.kv, status_key(job), decode_status)

    async def write_status(self, job: JobId, status: JobStatus, revision: int = 0) -> int:
        """Write the job's status; its new revision. Only the leader writes statuses, and its term's fence is what
        keeps a deposed one out (`revision` is the one it replaces, for the record)."""
        return await self._put(status_key(job), _enc.encode(status))

    async def idempotency(self, client_key: str) -> tuple[IdempotencyRecord, int] | None:
        return await _read(self.idem, idempotency_key(client_key), _dec_idem.decode)

    async def write_idempotency(self, client_key: str, record: IdempotencyRecord, revision: int) -> bool:
        """Write if nobody wrote it since `revision` (0: never); False when someone did."""
        try:
            await _write_if_unchanged(self.idem, idempotency_key(client_key), record, revision)
            return True
        except Conflict:
            return False

    async def forget_idempotency(self, client_key: str) -> None:
        await self.idem.delete(idempotency_key(client_key))

    # --- the active set: what a scheduler needs to lead -------------------------------------------
    async def has_active_set(self) -> bool:
        """Whether the bucket was written by a scheduler that keeps the active set (else: migrate it first)."""
        return await _read(self.kv, LAYOUT, msgspec.json.Decoder(int).decode) is not None

    async def mark_layout(self) -> None:
        await self.kv.put(LAYOUT, _enc.encode(2))

    async def drop_old_idempotency(self) -> None:
        """Keys from before the idempotency bucket: their window is long gone or they are in the new bucket."""
        await self.js.purge_stream(JOBS.stream, subject=JOBS.prefix + IDEMPOTENCY + ".>")

    async def rewrite_request(self, stored: StoredRequest) -> None:
        """For the migration only: a request gets its index entry."""
        await self._put(request_key(stored.id), _enc.encode(stored))

    async def mark_active(self, job: JobId) -> None:
        """The job is queued or holds a device: a scheduler taking over reads it (and only such jobs)."""
        await self._put(active_key(job), b"")

    async def unmark_active(self, job: JobId) -> None:
        """The job has ended. Purged, not deleted: a delete would leave a marker per finished job behind. In a term,
        one fenced write: a purge marker that replaces the mark and expires by itself a minute later."""
        if self.fence is not None:
            await self.fence.put(active_key(job), b"", PURGE_EXPIRING)
        else:
            await self.js.purge_stream(JOBS.stream, subject=JOBS.prefix + active_key(job))

    async def prepare_bucket(self) -> None:
        """The bucket's stream takes per-message time limits, for unmark_active's markers (nats-server 2.11+)."""
        config = (await self.js.stream_info(JOBS.stream)).config
        if not config.allow_msg_ttl:
            await self.js.update_stream(config.evolve(allow_msg_ttl=True))

    async def remove(self, job: JobId) -> None:
        """Every key of an expired job, purged so that nothing of it is left in the bucket."""
        for key in (request_key(job), status_key(job), active_key(job)):
            await self.js.purge_stream(JOBS.stream, subject=JOBS.prefix + key)

    async def load_active(
        self, concurrency: int = 128
    ) -> list[tuple[StoredRequest | None, JobStatus | None, int, JobId]]:
        """Every job marked active, with its request and status, read without touching finished jobs:
        (request or None when it was never stored, status or None, status revision, id)."""
        ids = await self.active_ids()
        slots = asyncio.Semaphore(concurrency)

        async def one(job: JobId):
            async with slots:
                try:
                    stored = without_data(await self.request(job))
                except KeyNotFoundError:
                    return None, None, 0, job
                status = await self.status(job)
                return (stored, *status, job) if status else (stored, None, 0, job)

        return list(await asyncio.gather(*(one(j) for j in ids)))

    async def active_ids(self) -> list[JobId]:
        """The ids of every job marked active (one pass over the marks, nothing else read)."""
        ids: list[JobId] = []
        await self._last_per_subject(
            JOBS.prefix + active_key(">"), lambda msg: ids.append(msg.subject.removeprefix(JOBS.prefix + ACTIVE + "."))
        )
        return ids

    async def load(self, timeout: float = 60.0) -> tuple[dict[str, StoredRequest], dict[str, tuple[JobStatus, int]]]:
        """Every job and status in the bucket, read in one pass over its stream: for a bucket written before
        the active set existed (see service._recover), never for leading."""
        requests: dict[str, StoredRequest] = {}
        statuses: dict[str, tuple[JobStatus, int]] = {}

        def take(msg) -> None:
            kind, job = kind_and_job(msg.subject.removeprefix(JOBS.prefix))
            if kind == REQUEST:
                requests[job] = without_data(decode_request(msg.data))
            elif kind == STATUS:
                statuses[job] = (decode_status(msg.data), msg.metadata.sequence.stream)

        await self._last_per_subject(JOBS.subjects, take, timeout)
        return requests, statuses

    async def _last_per_subject(self, subjects: str, take, timeout: float = 60.0) -> None:
        """Call take(msg) on the newest entry of every key matching `subjects` (deleted ones left out).

        The consumer's own count says how much there is, and each delivery how much is left, so an error or a
        server still restoring the stream raises LoadError instead of reading as 'no jobs'."""
        try:
            sub = await self.js.subscribe(
                subjects, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
            )
        except Exception as e:
            raise LoadError(f"the jobs bucket could not be read ({type(e).__name__}: {e})") from e
        seen = 0
        try:
            info = await sub.consumer_info()
            if info.num_pending == 0 and info.delivered.consumer_seq == 0:
                return
            while True:
                try:
                    msg = await sub.next_msg(timeout=timeout)
                except Exception as e:
                    raise LoadError(
                        f"the jobs bucket stopped delivering after {seen} keys "
                        f"({type(e).__name__}); nothing was concluded from it"
                    ) from e
                seen += 1
                if (msg.headers or {}).get(KV_OP) not in (KV_DEL, KV_PURGE):
                    take(msg)
                if msg.metadata.num_pending == 0:
                    return
        except LoadError:
            raise
        except Exception as e:
            raise LoadError(f"the jobs bucket could not be read ({type(e).__name__}: {e})") from e
        finally:
            await asyncio.shield(sub.unsubscribe())


async def _read(kv: KeyValue, key: str, decode):
    """The value under `key` and its revision; None when there is none."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    return decode(entry.value or b""), entry.revision


async def _write_if_unchanged(kv: KeyValue, key: str, value, revision: int) -> int:
    """Write if nobody wrote the key since `revision` (0: never written); the new revision, or Conflict."""
    try:
        if revision == 0:
            return await kv.create(key, _enc.encode(value))
        return await kv.update(key, _enc.encode(value), last=revision)
    except KeyWrongLastSequenceError as e:
        raise Conflict(e.description) from None
