"""History that does not grow forever: finished jobs leave memory after a while, and the store after the
retention time, with their events and (if asked) their artifacts."""

from __future__ import annotations

import asyncio
import logging
import time

from schemas import names
from schemas.artifacts import ArtifactQuery, Deleted
from schemas.jobs import Error
from services import bus
from services.aio import sleep_unless_stopped
from services.scheduler.core import SchedulerCore
from services.scheduler.index import Entry, decode_finished

log = logging.getLogger(__name__)
MEMORY_TICK_S = 1.0
EXPIRED_PER_SWEEP = 10_000  # so that one sweep after a long pause does not hold the scheduler's attention


class Retention:
    """Keeps the core's history bounded: finished jobs leave memory, then (after the retention time) the store."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core

    async def run(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        core = self.core
        next_sweep = 0.0
        tick = min(MEMORY_TICK_S, core.cfg.sweep_interval_s)
        while not await sleep_unless_stopped(stop, tick) and not lost.is_set():
            self._forget_finished(time.monotonic() - core.cfg.finished_in_memory_s)
            if core.cfg.retention_s > 0 and time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + core.cfg.sweep_interval_s
                try:
                    removed = await self.expire_history(time.time() - core.cfg.retention_s)
                    if removed:
                        log.info(
                            "removed %d finished jobs older than the retention time (%.0fs)",
                            removed,
                            core.cfg.retention_s,
                        )
                except Exception as e:  # the store or the artifact service away: the next sweep goes on
                    log.warning("removing expired jobs stopped (%s: %s); the next sweep goes on", type(e).__name__, e)

    def _forget_finished(self, ended_before: float) -> None:
        """Finished jobs that ended before `ended_before` (monotonic) leave memory, oldest first."""
        core = self.core
        while core.finished:
            job_id, ended = next(iter(core.finished.items()))
            if ended > ended_before:
                return
            job = core.jobs.get(job_id)
            if job is not None and job.lock.locked():  # a write to it is under way (its registration): later
                return
            core.forget(job_id)

    async def expire_history(self, finished_before: float) -> int:
        """Remove every job that finished before `finished_before` (wall clock), oldest first: its record, its
        events, its index entries and, if configured, its artifacts. Returns how many went."""
        removed, after = 0, 0
        while removed < EXPIRED_PER_SWEEP:
            entry = await self.core.index.oldest(names.job_index_finished(), after)
            if entry is None:
                return removed
            done = decode_finished(entry.data)
            if done.finished >= finished_before:
                return removed
            await self._remove_job(entry)
            after, removed = entry.seq, removed + 1
        return removed

    async def _remove_job(self, entry: Entry) -> None:
        core = self.core
        done = decode_finished(entry.data)
        if core.cfg.retention_artifacts:
            reply: Deleted | Error = await bus.request(
                core.nc, names.ARTIFACTS_DELETE, ArtifactQuery(job=done.job), Deleted | Error, timeout=10.0
            )  # type: ignore[arg-type]
            if isinstance(reply, Error):
                raise RuntimeError(f"the artifact service did not delete job {done.job}'s artifacts: {reply.error}")
        core.forget(done.job)
        await core.store.remove(done.job)
        await core.js.purge_stream(
            names.JOBS_STREAM, subject=names.job_events(done.job, names.tenant_token(done.tenant))
        )
        if done.submitted_seq:
            await core.index.remove(done.submitted_seq)
        await core.index.remove(entry.seq)  # last: a sweep cut short finds the job again
