"""The gateway's record of each job it created (names.GATEWAY_JOBS_KV, key `<tenant>.<job>`: what OpenAI's job
object shows and jetlora's does not), and a tenant's jobs newest first. A record is written once, so its revision
(its sequence in the bucket's stream) is its place in the list: a page is read back from there, a few requests
however many jobs came before."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from nats.js.errors import KeyNotFoundError, NotFoundError

from schemas import names, nats_subjects
from schemas.gateway import GatewayJob
from services.gateway.errors import bad_request, is_token
from services.gateway.paging import newest_before

SCAN_LIMIT = 10_000  # records a filtered page (metadata) may pass over; past it the page ends, has_more set


def record_key(tenant: str, job: str) -> str:
    return f"{tenant}.{job}"


class JobRecords:
    def __init__(self, js, kv) -> None:
        self.js, self.kv = js, kv
        self.stream = nats_subjects.kv(names.GATEWAY_JOBS_KV).stream
        self._decode = msgspec.json.Decoder(GatewayJob).decode

    async def put(self, record: GatewayJob) -> None:
        await self.kv.put(record_key(record.tenant, record.job), msgspec.json.encode(record))

    async def get(self, tenant: str, job: str) -> tuple[GatewayJob, int] | None:
        """The record and its place (revision); None for a job the gateway did not create for this tenant."""
        if not is_token(job):
            return None
        try:
            entry = await self.kv.get(record_key(tenant, job))
        except KeyNotFoundError:
            return None
        return (self._decode(entry.value), entry.revision) if entry.value else None

    async def newest(
        self, tenant: str, before: int | None, want: int, keep: Callable[[GatewayJob], bool] = lambda _: True
    ) -> tuple[list[GatewayJob], bool]:
        """Up to `want` of the tenant's records placed below `before` (None: from the newest) that `keep` takes,
        newest first; and whether the scan stopped at SCAN_LIMIT with more possibly left."""
        subject = f"{nats_subjects.kv(names.GATEWAY_JOBS_KV).prefix}{tenant}.*"
        hi = before if before is not None else (await self.js.stream_info(self.stream)).state.last_seq + 1
        budget = [SCAN_LIMIT]

        async def read(lo: int, cap: int, hi: int):
            items: list[tuple[int, GatewayJob]] = []
            seq = lo + 1
            while True:
                if budget[0] <= 0:  # this window was not read to its end: none of it is shown
                    return [], True
                try:
                    msg = await self.js.get_msg(self.stream, seq=seq, subject=subject, next=True)
                except NotFoundError:
                    return items, True
                if msg.seq >= hi:
                    return items, True
                if len(items) == cap:
                    return items, False
                budget[0] -= 1
                seq = msg.seq + 1
                if msg.data and (record := self._decode(msg.data)) and keep(record):  # a delete marker has no data
                    items.append((msg.seq, record))

        found = await newest_before(read, hi, want, window=want)  # each record read is a request: no wider
        return found, budget[0] <= 0


def metadata_filter(query) -> Callable[[GatewayJob], bool]:
    """OpenAI's `metadata[k]=v` (every pair must match) or `metadata=null` (jobs created without metadata)."""
    pairs = {k[len("metadata[") : -1]: v for k, v in query.items() if k.startswith("metadata[") and k.endswith("]")}
    if "metadata" in query:
        if query["metadata"] != "null" or pairs:
            raise bad_request(
                "metadata: filter with metadata[KEY]=VALUE (any number of them), or metadata=null for the jobs "
                "created without metadata; not both",
                "metadata",
            )
        return lambda r: not r.metadata
    return lambda r: all((r.metadata or {}).get(k) == v for k, v in pairs.items())
