"""A jobs bucket written before the active set and the job index is given both, once, before a scheduler
leads from it."""

from __future__ import annotations

import logging
import time

import msgspec

from schemas.job_status import TERMINAL_STATES
from services.scheduler.index import Finished, JobIndex
from services.scheduler.store import JobStore

log = logging.getLogger(__name__)


async def migrate(store: JobStore, index: JobIndex) -> None:
    """Index every job in submission order and mark the active ones. A job is done once its request names its
    index entry, so a migration cut short goes on where it stopped (a finished job's entry may then be twice)."""
    started = time.monotonic()
    requests, statuses = await store.load()
    todo = sorted((s for s in requests.values() if s.index_seq == 0), key=lambda s: s.seq)
    if todo:  # an empty bucket (a fresh store) has nothing to say
        log.info("the jobs bucket predates the job index: indexing its %d jobs (once)", len(todo))
    for stored in todo:
        full = await store.request(stored.id)
        seq = await index.submitted(stored.tenant, stored.id)
        status = statuses.get(stored.id, (None, 0))[0]
        if status is not None and status.state in TERMINAL_STATES:
            await index.finished(
                Finished(
                    job=stored.id,
                    tenant=stored.tenant,
                    state=status.state,
                    finished=status.updated or stored.created,
                    submitted_seq=seq,
                )
            )
        else:
            await store.mark_active(stored.id)
        await store.rewrite_request(msgspec.structs.replace(full, index_seq=seq))
    await store.drop_old_idempotency()
    await store.mark_layout()
    if todo:
        log.info("indexed %d jobs in %.1fs", len(todo), time.monotonic() - started)
