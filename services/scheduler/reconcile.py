"""Memory checked against the store, as a controller's reconcile loop: jobs whose last write went unanswered are
read back, active jobs the store holds but memory lacks are taken up, and the devices held and each node's jobs
are rebuilt from the statuses and compared with what memory holds."""

from __future__ import annotations

import asyncio
import logging
import time

from services.aio import wait_first
from schemas.job_status import TERMINAL_STATES
from services.scheduler.core import Job, SchedulerCore, held
from services.scheduler.grouping import holder

log = logging.getLogger(__name__)
RECHECK_PAUSE_S = 0.5  # between read-backs while the store does not answer


class Reconcile:
    """Runs while the scheduler leads: read-backs as soon as a write goes unanswered, the rest every
    `reconcile_interval_s`."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.adopted = 0  # active jobs found in the store and not in memory (each one is logged)
        self.drift = 0  # held devices or node memberships memory had wrong (each one is logged)

    async def run(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        core = self.core
        next_full = time.monotonic() + core.cfg.reconcile_interval_s
        while not (stop.is_set() or lost.is_set()):
            timeout = max(0.0, next_full - time.monotonic())
            try:
                await asyncio.wait_for(wait_first(core.recheck, stop, lost), timeout)
            except TimeoutError:
                pass
            if stop.is_set() or lost.is_set():
                return
            core.recheck.clear()
            if core.unsure and not await self.read_back():
                core.recheck.set()
                await asyncio.sleep(RECHECK_PAUSE_S)
            if time.monotonic() >= next_full:
                next_full = time.monotonic() + core.cfg.reconcile_interval_s
                try:
                    await self.take_up_missing()
                except Exception as e:  # the store away: the next round tries again
                    log.warning("could not compare memory with the store (%s: %s)", type(e).__name__, e)
                self.check_projection()

    async def read_back(self) -> bool:
        """Read back every job whose last write went unanswered; False if the store still does not answer."""
        core = self.core
        for job_id in list(core.unsure):
            job = core.jobs.get(job_id)
            if job is None:
                core.unsure.discard(job_id)
                continue
            try:
                async with job.lock:
                    if job_id in core.unsure:
                        await core.reload_locked(job)
            except Exception as e:
                log.warning("job %s: its status could not be read back yet (%s: %s)", job_id, type(e).__name__, e)
                return False
        return True

    async def take_up_missing(self) -> None:
        """Active jobs in the store that memory does not hold (none should be: each is logged and taken up)."""
        core = self.core
        for job_id in await core.store.active_ids():
            if job_id in core.jobs or job_id in core.submitting:
                continue
            found = await core.store.find(job_id)
            if found is None or job_id in core.jobs:
                continue  # marked, but its request was never stored (a submission cut short), or taken up meanwhile
            stored, status, revision = found
            if status is not None and status.state in TERMINAL_STATES:  # it ended; its end was not recorded whole
                await core.record_end(Job(stored, status, revision))
                continue
            log.error(
                "job %s is active in the store (%s) but was not in memory; taking it up",
                job_id,
                status.state if status else "queued",
            )
            job = core.adopt(stored, status, revision)
            self.adopted += 1
            if job.status.state not in ("queued", "paused") and not job.slots:
                log.error("job %s is %s on no device; it is re-read when it next changes", job_id, job.status.state)

    def _check_groups(self) -> None:
        """Rebuild the co-training groups' members from the statuses and placements; fix and log any drift."""
        core = self.core
        want: dict[str, set[str]] = {}
        for job in core.jobs.values():
            for group in {job.status.group if held(job.status) else None, job.placing_group} - {None}:
                want.setdefault(group, set()).add(job.id)  # type: ignore[arg-type]
        have = {g.id: set(g.members) for g in core.groups.by_id.values()}
        if want != have:
            log.error("memory's co-training groups drifted from the statuses (%s, not %s); rebuilt", have, want)
            for group, members in have.items():
                for job_id in members - want.get(group, set()):
                    core.groups.leave(group, job_id)
            for group, members in want.items():
                for job_id in members - have.get(group, set()):
                    job = core.jobs[job_id]
                    slot = (job.placing or held(job.status))[0]
                    core.groups.join(group, slot, job_id, job.stored.request, job.stored.tenant)
            self.drift += 1

    def check_projection(self) -> None:
        """Rebuild the devices held and each node's jobs from the statuses in memory; fix and log any drift."""
        core = self.core
        want: dict[tuple[str, int], str] = {}
        for job in core.jobs.values():
            claims = [(slot, holder(job.id, job.status.group)) for slot in held(job.status)]
            claims += [(slot, holder(job.id, job.placing_group)) for slot in job.placing or []]
            for slot, who in claims:
                if slot in want and want[slot] != who:
                    log.error("%s and %s both hold %s device %d", want[slot], who, *slot)
                want[slot] = who
        for slot, who in list(core.fleet.reserved.items()):
            if want.get(slot) != who:
                log.error("%s device %d was held for %s, whose status holds it not; freed", *slot, who)
                core.fleet.release(slot, who)
                self.drift += 1
        for slot, who in want.items():
            if core.fleet.reserved.get(slot) != who:
                log.error("%s device %d is %s's by its status but was not held; held", *slot, who)
                core.fleet.reserve(slot, who)
                self.drift += 1
        self._check_groups()
        nodes: dict[str, set[str]] = {}
        for job in core.jobs.values():
            if held(job.status) and job.status.node is not None:
                nodes.setdefault(job.status.node, set()).add(job.id)
        if {n: j for n, j in core.by_node.items() if j} != nodes:
            log.error("memory's jobs per node drifted from the statuses; rebuilt")
            core.by_node = nodes
            self.drift += 1
