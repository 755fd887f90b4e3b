"""Pausing and resuming jobs: asked by a user, or because a serving engine wants its device's memory back.

A paused job holds no device and keeps its place in the records; resumed, it goes back to the queue and
goes on from the checkpoint its pause stored, on any node that fits. A job paused for an engine is
resumed when that device's engine no longer needs the memory.
"""

from __future__ import annotations

import logging

from schemas import names
from schemas.jobs import ACTIVE_STATES, Error
from schemas.nodes import Control, ControlReply, Heartbeat
from services import bus
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.placement import SlotKey

log = logging.getLogger(__name__)
BY_USER = "user"


def engine_tag(slot: SlotKey) -> str:
    """How a pause for a device's serving engine is recorded (JobStatus.paused_by)."""
    return f"engine {slot[0]}/{slot[1]}"


def engine_slot(paused_by: str | None) -> SlotKey | None:
    if not paused_by or not paused_by.startswith("engine "):
        return None
    node, _, device = paused_by.removeprefix("engine ").rpartition("/")
    return (node, int(device)) if device.lstrip("-").isdigit() else None


class SchedulerPausing(SchedulerCore):
    async def _pause(self, job: Job, by: str) -> Error | None:
        """Pause a queued job at once, or ask its node to checkpoint a running one; an Error says why not."""
        state = job.status.state

        def waiting(s) -> bool:  # queued and not being placed (placing sets the node before the write)
            return s.state == "queued" and s.node is None

        if state == "queued":
            if not waiting(job.status):
                return Error(f"job {job.id} is being placed on {job.status.node} right now; ask again", field="job")
            self.queue.discard(job.id)
            if await self._set_state(job, "paused", f"paused while queued (by {by})", paused_by=by, when=waiting):
                self._paused(job)
                return None
            if waiting(job.status):  # the write failed, the job did not move: it keeps its place
                self._enqueue(job)
            return Error(f"job {job.id} was just placed; ask again", field="job")
        if state not in ACTIVE_STATES or state == "uploading":
            why = "is storing its artifacts and ends in a moment" if state == "uploading" else f"is {state}"
            return Error(f"job {job.id} {why}; only queued and running jobs pause", field="job")
        try:
            reply = await bus.request(self.nc, names.node(job.status.node).control, Control(job.id, "pause", by),
                                      ControlReply, timeout=self.cfg.assign_timeout)
        except bus.RequestError as e:
            return Error(f"node {job.status.node} did not answer the pause ({e}); ask again", field="job")
        return None if reply.ok else Error(reply.message, field="job")

    async def _resume(self, job: Job, why: str) -> Error | None:
        if job.status.state != "paused":
            return Error(f"job {job.id} is {job.status.state}, not paused", field="job")
        self._unpaused(job)
        await self._requeue(job, why, when=lambda s: s.state == "paused", paused_by=None)
        return None

    # --- which paused jobs wait for which engine ------------------------------------------------
    def _adopt(self, stored, status, revision: int) -> Job:
        job = super()._adopt(stored, status, revision)
        if job.status.state == "paused":
            self._paused(job)
        return job

    def _paused(self, job: Job) -> None:
        if (slot := engine_slot(job.status.paused_by)) is not None:
            self.engine_paused.setdefault(slot, set()).add(job.id)

    def _unpaused(self, job: Job) -> None:
        if (slot := engine_slot(job.status.paused_by)) is not None:
            self.engine_paused.get(slot, set()).discard(job.id)

    def _react_to_engines(self, hb: Heartbeat) -> None:
        """A device whose engine wants memory back pauses its job (if its priority allows); one whose engine no
        longer does resumes the jobs paused for it."""
        for dev in hb.devices:
            slot = (hb.node, dev.index)
            if dev.reclaim_mib:
                for job_id in dev.jobs:
                    job = self.jobs.get(job_id)
                    if (job is not None and job.status.state in ACTIVE_STATES and job_id not in self.pausing
                            and job.stored.request.priority <= self.cfg.reclaim_pause_priority):
                        self.pausing.add(job_id)
                        self._spawn(self._pause_for_engine(job, slot, dev.reclaim_mib))
            elif self.engine_paused.get(slot):
                for job_id in list(self.engine_paused.pop(slot)):
                    why = f"resumed: the serving engine on {hb.node} device {dev.index} no longer needs the memory"
                    self._spawn(self._resume(self.jobs[job_id], why))

    async def _pause_for_engine(self, job: Job, slot: SlotKey, mib: int) -> None:
        try:
            log.info("pausing job %s: the serving engine on %s device %d wants %d MiB back", job.id, *slot, mib)
            if error := await self._pause(job, engine_tag(slot)):
                log.warning("could not pause job %s for the engine on %s device %d: %s", job.id, *slot, error.error)
        finally:
            self.pausing.discard(job.id)
