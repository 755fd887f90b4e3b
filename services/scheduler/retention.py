"""History that does not grow forever: finished jobs leave memory after a while, and the store after the
retention time, with their events and (if asked) their artifacts: never those a registered adapter version is
made of. Which those are, the registry says over NATS (jetlora.adapters.references); a registry that does not
answer stops the sweep, and nothing is deleted until it does. The registry keeps its versions (it has no delete),
so a registered job's PEFT and GGUF files stay while its record, events, checkpoints and TensorBoard logs go."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import get_args

from schemas import names
from schemas.artifacts import ArtifactKind, ArtifactQuery, Deleted
from schemas.jobs import Error
from schemas.registry import JobReferences, References, ReferencesQuery
from services import bus
from services.aio import sleep_unless_stopped
from services.scheduler.core import SchedulerCore
from services.scheduler.index import Entry, decode_finished

log = logging.getLogger(__name__)
MEMORY_TICK_S = 1.0
EXPIRED_PER_SWEEP = 10_000  # so that one sweep after a long pause does not hold the scheduler's attention
ASKED_AT_ONCE = 100  # expired jobs the registry is asked about in one request


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
        events, its index entries and, if configured, the artifacts no registered version is made of. Returns how
        many went."""
        removed, after = 0, 0
        while removed < EXPIRED_PER_SWEEP:
            batch = await self._expired(finished_before, after, min(ASKED_AT_ONCE, EXPIRED_PER_SWEEP - removed))
            if not batch:
                return removed
            referenced = await self._referenced(batch) if self.core.cfg.retention_artifacts else {}
            for entry in batch:
                await self._remove_job(entry, referenced)
                after, removed = entry.seq, removed + 1
        return removed

    async def _expired(self, finished_before: float, after: int, limit: int) -> list[Entry]:
        """Up to `limit` index entries of jobs that finished before `finished_before`, oldest first, after `after`."""
        batch: list[Entry] = []
        while len(batch) < limit:
            entry = await self.core.index.oldest(names.job_index_finished(), after)
            if entry is None or decode_finished(entry.data).finished >= finished_before:
                break
            batch.append(entry)
            after = entry.seq
        return batch

    async def _referenced(self, batch: list[Entry]) -> dict[str, JobReferences]:
        """The registry's word on which of these jobs' artifacts its versions reference; raises when it has none."""
        jobs = [decode_finished(e.data).job for e in batch]
        try:
            reply = await bus.request(
                self.core.nc, names.ADAPTERS.references, ReferencesQuery(jobs=jobs), References | Error, timeout=10.0
            )  # type: ignore[arg-type]
        except bus.RequestError as e:
            raise RuntimeError(
                f"the adapter registry did not say which artifacts its versions reference ({e}); no job is removed "
                "until it does"
            ) from None
        if isinstance(reply, Error):
            raise RuntimeError(
                f"the adapter registry did not say which artifacts its versions reference: {reply.error}"
            )
        return {r.job: r for r in reply.jobs}

    async def _delete_artifacts(self, job: str, referenced: JobReferences | None) -> None:
        """The job's artifacts, but those a registered version references (every kind, or the kinds they are not)."""
        queries = (
            [ArtifactQuery(job=job)]
            if referenced is None
            else [
                ArtifactQuery(job=job, kind=kind)
                for kind in get_args(ArtifactKind)
                if names.artifact_name(job, kind) not in referenced.artifacts
            ]
        )
        for query in queries:
            reply: Deleted | Error = await bus.request(
                self.core.nc, names.ARTIFACTS_DELETE, query, Deleted | Error, timeout=10.0
            )  # type: ignore[arg-type]
            if isinstance(reply, Error):
                raise RuntimeError(f"the artifact service did not delete job {job}'s artifacts: {reply.error}")
        if referenced is not None:
            log.info(
                "kept %s of expired job %s: %s %s made of them",
                ", ".join(referenced.artifacts),
                job,
                ", ".join(referenced.versions),
                "is" if len(referenced.versions) == 1 else "are",
            )

    async def _remove_job(self, entry: Entry, referenced: dict[str, JobReferences]) -> None:
        core = self.core
        done = decode_finished(entry.data)
        if core.cfg.retention_artifacts:
            await self._delete_artifacts(done.job, referenced.get(done.job))
        core.forget(done.job)
        await core.store.remove(done.job)
        await core.js.purge_stream(
            names.JOBS_STREAM, subject=names.job_events(done.job, names.tenant_token(done.tenant))
        )
        if done.submitted_seq:
            await core.index.remove(done.submitted_seq)
        await core.index.remove(entry.seq)  # last: a sweep cut short finds the job again
