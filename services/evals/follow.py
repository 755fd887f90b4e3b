"""The evals service follows the jobs bucket (read-only, through its stored format): as an eval run's job ends, the
run is finished at once (its summary stored with it), not only when someone next reads it. Status updates of
every job pass; only an ended job's request is looked up (is it an eval run's?). At each start, once the bucket's
current values have passed, every unfinished run is brought up to date, so runs that ended while no evals service
ran are finished too. Any number of evals services may follow: runs.refresh writes with compare-and-set."""

from __future__ import annotations

import asyncio
import logging
import time

from schemas import names
from schemas.job_records import decode_status, status_key
from services.aio import sleep_unless_stopped
from services.evals import runs
from services.evals.store import EvalStore
from services.job_records import JobRecords

log = logging.getLogger(__name__)
JOB_ENDED = {"succeeded", "failed", "stopped", "cancelled"}


async def keep_following(js, store: EvalStore, jobs: JobRecords, stop: asyncio.Event) -> None:
    """follow() until stopped; a watch the server broke (a restart) starts again, with a growing backoff."""
    pause = 0.5
    while not stop.is_set():
        began = time.monotonic()
        try:
            await follow(js, store, jobs, stop)
        except Exception as e:
            pause = 0.5 if time.monotonic() - began > 60 else pause
            log.warning("evals: following the jobs failed (%s: %s); again in %.1fs", type(e).__name__, e, pause)
            await sleep_unless_stopped(stop, pause)
            pause = min(pause * 2, 30.0)


async def follow(js, store: EvalStore, jobs: JobRecords, stop: asyncio.Event) -> None:
    kv = await js.key_value(names.JOBS_KV)
    watcher = await kv.watch(status_key("*"), ignore_deletes=True)
    caught_up = False
    try:
        while not stop.is_set():
            try:
                entry = await watcher.updates(timeout=1.0)
            except (asyncio.TimeoutError, TimeoutError):
                continue
            if entry is None:  # the end of the current values: what ended before now is found by the sweep
                caught_up = True
                await sweep(store, jobs)
                continue
            if caught_up and entry.value and decode_status(entry.value).state in JOB_ENDED:
                await job_ended(store, jobs, entry.key.partition(".")[2])
    finally:
        await watcher.stop()


async def sweep(store: EvalStore, jobs: JobRecords) -> None:
    for run in await store.runs(None):  # every tenant's
        if run.state not in runs.ENDED:
            await runs.refresh(store, jobs, run)


async def job_ended(store: EvalStore, jobs: JobRecords, job: str) -> None:
    found = await jobs.find(job)
    if found is None or found.stored.request.evaluate is None:
        return  # not an eval run's job
    run = await store.run(found.stored.tenant, found.stored.request.evaluate.run)
    if run is not None:
        finished = await runs.refresh(store, jobs, run)
        log.info("evals: run %s %s (job %s)", run.id, finished.state, job)
