"""The jobs bucket read by the services that do not own it (the artifact service checks who may upload for a job,
the registry reads what a job made): one job's record, through the bucket's stored format (schemas/job_records.py),
read-only. A stored record answers while the scheduler is between leaders, where a request to it would not."""

from __future__ import annotations

from typing import NamedTuple

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from schemas import names
from schemas.job_records import decode_request, decode_status, request_key, status_key, without_data
from schemas.jobs import JobId
from schemas.job_status import JobStatus, StoredRequest


class JobRecord(NamedTuple):
    """One job as the bucket holds it."""

    stored: StoredRequest  # without its inline data
    status: JobStatus | None  # None: never written (the job was stored and not yet queued)


class JobRecords:
    """Reads one job's keys of the jobs bucket by direct lookups: nothing is written, no consumer is made."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, js) -> JobRecords:
        return cls(await js.key_value(names.JOBS_KV))

    async def find(self, job: JobId) -> JobRecord | None:
        """The job's request and status; None when the bucket has no such job."""
        try:
            request = await self.kv.get(request_key(job))
        except KeyNotFoundError:
            return None
        try:
            status = await self.kv.get(status_key(job))
        except KeyNotFoundError:
            return JobRecord(without_data(decode_request(request.value or b"")), None)
        return JobRecord(without_data(decode_request(request.value or b"")), decode_status(status.value or b""))
