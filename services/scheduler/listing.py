"""Pages of jobs, newest first: active states from memory, everything else from the job index, so a page
costs what it shows however many jobs the store holds."""

from __future__ import annotations

import asyncio

from schemas import names
from schemas.job_status import TERMINAL_STATES, JobList, JobListQuery, JobStatus, JobSummary, summarize
from services.scheduler.index import Entry, JobIndex, decode_finished
from services.scheduler.store import JobStore

SCAN_LIMIT = 5000  # index entries one page may pass over (a node filter over old jobs): the page is then short
BATCH = 64  # entries resolved at once


def from_memory(jobs, q: JobListQuery, tenant: str | None) -> JobList:
    """Jobs in a state that only active jobs have: all of them are in memory."""
    chosen = sorted(
        (
            j
            for j in jobs
            if j.status.state == q.state
            and (q.node is None or j.status.node == q.node)
            and (tenant is None or j.stored.tenant == tenant)
            and (q.after is None or j.stored.index_seq < q.after)
        ),
        key=lambda j: j.stored.index_seq,
        reverse=True,
    )
    page = chosen[: q.limit]
    more = len(chosen) > q.limit
    return JobList([summarize(j.stored, j.status) for j in page], next=page[-1].stored.index_seq if more else None)


async def from_index(index: JobIndex, store: JobStore, memory: dict, q: JobListQuery, tenant: str | None) -> JobList:
    """Walk the index back from `after`; a job still in memory is shown as memory has it (its latest progress)."""
    token = "*" if tenant is None else names.tenant_token(tenant)
    finished = q.state is not None and q.state in TERMINAL_STATES
    subject = names.job_index_finished(token, q.state or "*") if finished else names.job_index_submitted(token)
    out: list[JobSummary] = []
    end = await index.end()
    cursor, scanned = min(q.after, end) if q.after is not None else end, 0
    while len(out) < q.limit and scanned < SCAN_LIMIT:
        entries = await index.newest_before(subject, cursor, min(BATCH, q.limit - len(out)))
        if not entries:
            return JobList(out, next=None)
        scanned += len(entries)
        for entry, summary in zip(
            entries, await asyncio.gather(*(_summary(store, memory, e, finished) for e in entries))
        ):
            cursor = entry.seq
            if summary is not None and (q.node is None or summary.node == q.node):
                out.append(summary)
                if len(out) == q.limit:
                    break
    more = await index.before(subject, cursor) is not None
    return JobList(out, next=cursor if more else None)


async def _summary(store: JobStore, memory: dict, entry: Entry, finished: bool) -> JobSummary | None:
    job_id = decode_finished(entry.data).job if finished else entry.data.decode()
    if (job := memory.get(job_id)) is not None:
        return summarize(job.stored, job.status)
    found = await store.find(job_id)
    if found is None:  # its request was never stored (a crash between the two writes) or it just expired
        return None
    stored, status, _ = found
    return summarize(stored, status or JobStatus(updated=stored.created))
