"""The evals service follows the jobs bucket (read-only, through its stored format): as an eval run's job ends, the
run is finished at once (its summary stored with it), not only when someone next reads it. It watches the runs (the
evals bucket) and the status of each unfinished run's job alone (a watch of that one key, its current value first),
so other jobs' status writes never reach it: following every status cost the scheduler's process, which runs this
service, about a tenth of its CPU in a burst of submissions (bench/control_plane.py, ~3 status writes a job). At each
start, once the runs' current values have passed, every unfinished run is brought up to date, so runs that ended
while no evals service ran are finished too. Any number of evals services may follow: runs.refresh writes with
compare-and-set."""

from __future__ import annotations

import asyncio
import logging

from schemas import names
from schemas.evals import DECODERS
from schemas.job_records import decode_status, status_key
from services.aio import cancel_and_wait
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
    """Finish each unfinished run as its job ends: the runs are followed, and each unfinished run's job's status
    (RunJobs). The runs' watch broken ends it (raised, for keep_following to start again)."""
    await RunJobs(store, jobs, await js.key_value(names.JOBS_KV)).follow(stop)


class RunJobs:
    """The jobs of unfinished runs, from a watch of the runs, each job's status watched while its run is unfinished;
    a run stored after its job already ended is brought up to date as it is seen."""

    def __init__(self, store: EvalStore, jobs: JobRecords, kv) -> None:
        self.store, self.jobs, self.kv = store, jobs, kv
        self.unfinished: dict[str, tuple[str | None, str]] = {}  # job -> (tenant, run)
        self.watching: dict[str, asyncio.Event] = {}  # job -> what ends the watch of its status
        self.tasks: set[asyncio.Task] = set()  # those watches
        self.caught_up = False

    async def follow(self, stop: asyncio.Event) -> None:
        self.caught_up = False
        try:
            await watch_kv(self.store.kv, "run.>", stop, self.changed, self._current, ignore_deletes=False)
        finally:
            self.watching.clear()
            await cancel_and_wait(list(self.tasks))

    async def _current(self) -> None:  # what ended before now is found by the sweep
        self.caught_up = True
        await sweep(self.store, self.jobs)

    async def changed(self, entry) -> None:
        run = DECODERS["run"].decode(entry.value) if entry.value else None
        if run is None or run.state in runs.ENDED or not run.job:
            self.unfinished = {j: r for j, r in self.unfinished.items() if r[1] != entry.key.split(".")[-1]}
            for job in [j for j in self.watching if j not in self.unfinished]:
                self.watching.pop(job).set()  # its watch ends within controller.POLL_S
            return
        new = run.job not in self.unfinished
        self.unfinished[run.job] = (run.tenant, run.id)
        if run.job not in self.watching:
            self._watch(run.job)
        if new and self.caught_up:  # its job may have ended before the run was stored
            await runs.refresh(self.store, self.jobs, run)

    def _watch(self, job: str) -> None:
        """Watch the job's status (its current value first) until it ends or its run does."""
        done = asyncio.Event()

        async def status(entry) -> None:
            if entry.value and decode_status(entry.value).state in JOB_ENDED and not done.is_set():
                done.set()
                self.watching.pop(job, None)
                if job in self.unfinished:
                    await job_ended(self.store, self.jobs, self.unfinished[job])

        watch = keep(done, f"evals: following job {job}", lambda stop: watch_kv(self.kv, status_key(job), stop, status))
        self.watching[job] = done
        task = asyncio.create_task(watch)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


async def sweep(store: EvalStore, jobs: JobRecords) -> None:
    for run in await store.runs(None):  # every tenant's
        if run.state not in runs.ENDED:
            await runs.refresh(store, jobs, run)


async def job_ended(store: EvalStore, jobs: JobRecords, which: tuple[str | None, str]) -> None:
    run = await store.run(*which)
    if run is not None:
        finished = await runs.refresh(store, jobs, run)
        log.info("evals: run %s %s (job %s)", run.id, finished.state, run.job)
