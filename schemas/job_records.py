"""A stored format: the scheduler's jobs bucket (names.JOBS_KV), as its writer (services/scheduler/store.py) and
every reader (services/job_records.py) see it. One job is three keys: `request.<id>` (its StoredRequest, written
once), `status.<id>` (its JobStatus, rewritten at each change) and `active.<id>` (present while it is unfinished:
what a scheduler taking over reads); `term` is the leaders' fence and `layout` marks a bucket that has the active
set. Values are JSON."""

from __future__ import annotations

import hashlib

import msgspec

from schemas import names, nats_subjects
from schemas.jobs import JobId
from schemas.job_status import JobStatus, StoredRequest

REQUEST, STATUS, ACTIVE, IDEMPOTENCY = "request", "status", "active", "idem"
TERM = "term"  # the leaders' fence: each new term is a compare-and-set on it
LAYOUT = "layout"  # present once the bucket has the active set and the job index
JOBS = nats_subjects.kv(names.JOBS_KV)

decode_request = msgspec.json.Decoder(StoredRequest).decode
decode_status = msgspec.json.Decoder(JobStatus).decode


def request_key(job: JobId) -> str:
    return f"{REQUEST}.{job}"


def status_key(job: JobId) -> str:
    return f"{STATUS}.{job}"


def active_key(job: JobId) -> str:
    return f"{ACTIVE}.{job}"


def idempotency_key(client_key: str) -> str:
    """A client's key may hold any text; the bucket's key is its digest (names.IDEMPOTENCY_KV)."""
    return f"{IDEMPOTENCY}.{hashlib.sha256(client_key.encode()).hexdigest()}"


def kind_and_job(key: str) -> tuple[str, str]:
    """(REQUEST, STATUS or ACTIVE, the job's id) of a job's key; ("", "") for the bucket's own keys."""
    kind, _, job = key.partition(".")
    return (kind, job) if job else ("", "")


def without_data(stored: StoredRequest) -> StoredRequest:
    """A request without its inline training data: what a reader keeps (the data matters only to assign a job)."""
    return msgspec.structs.replace(stored, request=msgspec.structs.replace(stored.request, data=[]))
