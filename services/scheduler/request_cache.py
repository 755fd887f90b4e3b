"""Full requests (with their inline data) of the jobs just submitted, kept in memory up to a budget, so placing one
needs no read of the jobs bucket; a job placed or ended takes its request out."""

from __future__ import annotations

from schemas.jobs import JobId, JobRequest

REQUEST_CACHE_BYTES = 64 * 2**20  # full requests of queued jobs kept in memory, so placing one needs no KV read
REQUEST_CACHE_ITEM = 64 * 2**10  # a request larger than this is read back from the store when placed


class RequestCache:
    def __init__(self) -> None:
        self.requests: dict[JobId, tuple[JobRequest, int]] = {}  # job -> (request with data, its size)
        self.bytes = 0

    def put(self, job_id: JobId, request: JobRequest, size: int) -> None:
        if size <= REQUEST_CACHE_ITEM and self.bytes + size <= REQUEST_CACHE_BYTES:
            self.requests[job_id] = (request, size)
            self.bytes += size

    def take(self, job_id: JobId) -> JobRequest | None:
        entry = self.requests.pop(job_id, None)
        if entry is None:
            return None
        self.bytes -= entry[1]
        return entry[0]
