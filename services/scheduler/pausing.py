"""Pausing and resuming jobs: asked by a user, or because a serving engine wants its device's memory back.

A paused job holds no device and keeps its place in the records; resumed, it goes back to the queue and
goes on from the checkpoint its pause stored, on any node that fits. A job paused for an engine is
resumed when that device's engine no longer needs the memory.
"""

from __future__ import annotations

import logging

from schemas.jobs import Error
from schemas.job_status import ACTIVE_STATES
from schemas.nodes import Control, ControlReply, Heartbeat
from services import bus
from services.scheduler.config import engine_priority
from services.scheduler import commands
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.engine_pauses import engine_tag
from services.scheduler.fleet import SlotKey

log = logging.getLogger(__name__)
BY_USER = "user"
PREEMPTED = "preempted: "  # how a pause by preemption is recorded (JobStatus.paused_by), who and why after it


def is_preemption(paused_by: str | None) -> bool:
    return bool(paused_by) and paused_by.startswith(PREEMPTED)  # type: ignore[union-attr]


class Pausing:
    """Pauses and resumes jobs in the core: a user's, and those a device's serving engine asks for."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core

    async def pause(self, job: Job, by: str) -> Error | None:
        """Pause a queued job at once, or ask its node to checkpoint a running one; an Error says why not."""
        core, state = self.core, job.status.state

        if state == "queued":
            if job.placing:
                return Error(f"job {job.id} is being placed right now; ask again", field="job")
            if await core.set_state(
                job, "paused", f"paused while queued (by {by})", paused_by=by, when=lambda s: s.state == "queued"
            ):
                return None
            return Error(f"job {job.id} was just placed; ask again", field="job")
        if state not in ACTIVE_STATES or state == "uploading":
            why = "is storing its artifacts and ends in a moment" if state == "uploading" else f"is {state}"
            return Error(f"job {job.id} {why}; only queued and running jobs pause", field="job")
        try:
            reply = await commands.send(
                core,
                job.status.node or "",
                "control",
                Control(job.id, "pause", by, attempt=job.status.attempt),
                ControlReply,
            )
        except bus.RequestError as e:
            return Error(f"node {job.status.node} did not answer the pause ({e}); ask again", field="job")
        return None if reply.ok else Error(reply.message, field="job")

    async def resume(self, job: Job, why: str) -> Error | None:
        if job.status.state != "paused":
            return Error(f"job {job.id} is {job.status.state}, not paused", field="job")
        await self.core.requeue(job, why, when=lambda s: s.state == "paused", paused_by=None)
        return None

    def react_to_engines(self, hb: Heartbeat) -> None:
        """A device whose engine wants memory back pauses its job (if it gives way: gives_way); one whose engine no
        longer does resumes the jobs paused for it."""
        core = self.core
        for dev in hb.devices:
            slot = (hb.node, dev.index)
            if dev.reclaim_mib:
                for job_id in dev.jobs:
                    job = core.jobs.get(job_id)
                    if (
                        job is not None
                        and job.status.state in ACTIVE_STATES
                        and job_id not in core.pausing
                        and self.gives_way(job)
                    ):
                        core.pausing.add(job_id)
                        core.spawn(self._pause_for_engine(job, slot, dev.reclaim_mib))
            elif core.engine_paused.get(slot):
                for job_id in list(core.engine_paused.pop(slot)):
                    why = f"resumed: the serving engine on {hb.node} device {dev.index} no longer needs the memory"
                    core.spawn(self.resume(core.jobs[job_id], why))

    def gives_way(self, job: Job) -> bool:
        """Whether the job pauses for an engine that wants its device's memory: a tenant's always (no number a
        tenant writes keeps a device from its engine), an admin's at or below --reclaim-pause-priority."""
        priority = engine_priority(job.stored)
        return priority is None or priority <= self.core.cfg.reclaim_pause_priority

    async def _pause_for_engine(self, job: Job, slot: SlotKey, mib: int) -> None:
        try:
            log.info("pausing job %s: the serving engine on %s device %d wants %d MiB back", job.id, *slot, mib)
            if error := await self.pause(job, engine_tag(slot)):
                log.warning("could not pause job %s for the engine on %s device %d: %s", job.id, *slot, error.error)
        finally:
            self.core.pausing.discard(job.id)
