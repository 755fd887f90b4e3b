"""The evals service follows the jobs bucket (read-only, through its stored format): as an eval run's job ends, the
run is finished at once (its summary stored with it), not only when someone next reads it. Status updates of
every job pass; only the jobs of unfinished runs (followed in the evals bucket) are looked up when they end. At each start, once the bucket's
current values have passed, every unfinished run is brought up to date, so runs that ended while no evals service
ran are finished too. Any number of evals services may follow: runs.refresh writes with compare-and-set."""

from __future__ import annotations

import asyncio
import logging

from schemas import names
from schemas.evals import DECODERS
from schemas.job_records import decode_status, status_key
from services.aio import together
from services.controller import keep, watch_kv
from services.evals import runs
from services.evals.store import EvalStore
from services.job_records import JobRecords

log = logging.getLogger(__name__)
JOB_ENDED = {"succeeded", "failed", "stopped", "cancelled"}


async def keep_following(js, store: EvalStore, jobs: JobRecords, stop: asyncio.Event) -> None:
    """follow() until stopped; a watch the server broke (a restart) starts again, with a growing backoff."""
    await keep(stop, "evals: following the jobs", lambda stop: follow(js, store, jobs, stop))


async def follow(js, store: EvalStore, jobs: JobRecords, stop: asyncio.Event) -> None:
    """Finish each unfinished run as its job ends. The runs are followed too (their bucket holds only runs and
    evals), so an ended job is looked up only when it is a run's: other jobs' statuses pass unread. Either watch
    broken ends both (raised, for keep_following to start again)."""
    kv = await js.key_value(names.JOBS_KV)
    runs_of = RunJobs(store, jobs)
    caught_up = False

    async def status(entry) -> None:
        job = entry.key.partition(".")[2]
        if caught_up and job in runs_of.unfinished and entry.value and decode_status(entry.value).state in JOB_ENDED:
            await job_ended(store, jobs, runs_of.unfinished[job])

    async def current() -> None:  # what ended before now is found by the sweep
        nonlocal caught_up
        caught_up = True
        await sweep(store, jobs)

    await together(watch_kv(kv, status_key("*"), stop, status, current), runs_of.follow(stop))


class RunJobs:
    """The jobs of unfinished runs, from a watch of the runs: a run stored after its job already ended is brought
    up to date as it is seen."""

    def __init__(self, store: EvalStore, jobs: JobRecords) -> None:
        self.store, self.jobs = store, jobs
        self.unfinished: dict[str, tuple[str | None, str]] = {}  # job -> (tenant, run)
        self.caught_up = False

    async def follow(self, stop: asyncio.Event) -> None:
        self.caught_up = False
        await watch_kv(self.store.kv, "run.>", stop, self.changed, self._current, ignore_deletes=False)

    async def _current(self) -> None:
        self.caught_up = True

    async def changed(self, entry) -> None:
        run = DECODERS["run"].decode(entry.value) if entry.value else None
        if run is None or run.state in runs.ENDED or not run.job:
            self.unfinished = {j: r for j, r in self.unfinished.items() if r[1] != entry.key.split(".")[-1]}
            return
        new = run.job not in self.unfinished
        self.unfinished[run.job] = (run.tenant, run.id)
        if new and self.caught_up:  # its job may have ended before the run was stored
            await runs.refresh(self.store, self.jobs, run)


async def sweep(store: EvalStore, jobs: JobRecords) -> None:
    for run in await store.runs(None):  # every tenant's
        if run.state not in runs.ENDED:
            await runs.refresh(store, jobs, run)


async def job_ended(store: EvalStore, jobs: JobRecords, which: tuple[str | None, str]) -> None:
    run = await store.run(*which)
    if run is not None:
        finished = await runs.refresh(store, jobs, run)
        log.info("evals: run %s %s (job %s)", run.id, finished.state, run.job)
