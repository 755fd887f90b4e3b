"""What a node runs, against what the records say it should: every attempt a heartbeat lists is either the job's
current one on that node, one this scheduler gave up on while the node was silent and takes back (the job still
waits, the node still runs it: nothing is thrown away), or ended on the node. A node whose loop stalled past the
window converges within one heartbeat of coming back."""

from __future__ import annotations

import logging
import time

from schemas.job_status import ACTIVE_STATES, TERMINAL_STATES, JobState
from schemas.nodes import Control, ControlReply, Heartbeat, RunningAttempt
from services import bus
from services.scheduler import commands
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.grouping import holder

log = logging.getLogger(__name__)
RESEND_AFTER_HEARTBEATS = 2  # an end the node still has not acted on is asked again after this many heartbeats


class Attempts:
    """Compares each heartbeat's attempts with the records: keeps, takes back or ends each one."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.asked: dict[tuple[str, str, int], float] = {}  # (node, job, attempt) -> when its end was last asked
        self.ended = 0  # ends asked of nodes
        self.taken_back = 0  # attempts taken back

    def compare(self, hb: Heartbeat) -> None:
        core = self.core
        now = time.monotonic()
        for key in [k for k in self.asked if k[0] == hb.node]:
            if (key[1], key[2]) not in {(a.job, a.attempt) for a in hb.attempts}:
                del self.asked[key]  # the node ended it
        for a in hb.attempts:
            job = core.jobs.get(a.job)
            if job is not None and _current(job, hb.node, a):
                continue
            if job is not None and self._can_take_back(job, hb, a):
                core.hold_for(job, [(hb.node, d) for d in a.devices], a.group)
                core.spawn(self._take_back(job, hb.node, a))
                continue
            key = (hb.node, a.job, a.attempt)
            if now - self.asked.get(key, float("-inf")) < RESEND_AFTER_HEARTBEATS * core.cfg.heartbeat_interval:
                continue
            self.asked[key] = now
            core.spawn(self._end(hb.node, a, job))

    def forget_node(self, node: str) -> None:
        """A node gone for good: nothing it ran is asked about any more."""
        for key in [k for k in self.asked if k[0] == node]:
            del self.asked[key]

    def _can_take_back(self, job: Job, hb: Heartbeat, a: RunningAttempt) -> bool:
        """The job waits in the queue because this node went silent while it ran this very attempt, and the
        devices it runs on are held by no other job."""
        core, s = self.core, job.status
        return (
            s.state == "queued"
            and s.attempt == a.attempt
            and job.lost_from is not None
            and job.lost_from[:2] == (hb.node, a.attempt)
            and job.placing is None
            and not job.lock.locked()
            and job.id not in core.unsure
            and not hb.draining
            and bool(a.devices)
            and all(core.fleet.reserved.get((hb.node, d)) in (None, job.id, holder(job.id, a.group)) for d in a.devices)
        )

    async def _take_back(self, job: Job, node: str, a: RunningAttempt) -> None:
        core = self.core
        assert job.lost_from is not None
        retries_used = job.lost_from[2]
        state: JobState = a.state if a.state in ACTIVE_STATES and a.state != "assigned" else "running"
        try:
            written = await core.set_state(
                job,
                state,
                f"node {node} answered again and still runs attempt {a.attempt}; it goes on there",
                when=lambda s: s.state == "queued" and s.attempt == a.attempt,
                node=node,
                device=a.devices[0],
                devices=a.devices if len(a.devices) > 1 else [],
                group=a.group,
                retries_used=retries_used,
            )
        except Exception as e:
            log.warning("could not take back attempt %d of job %s on %s: %s", a.attempt, job.id, node, e)
            written = False
        finally:
            core.unhold(job)
        if written:
            self.taken_back += 1
            job.lost_from = None
            log.warning(
                "node %s answered again and still runs attempt %d of job %s: taken back", node, a.attempt, job.id
            )
        else:  # placed elsewhere or ended meanwhile: the next heartbeat ends it there
            self.asked.pop((node, job.id, a.attempt), None)

    async def _end(self, node: str, a: RunningAttempt, job: Job | None) -> None:
        """Ask the node to end an attempt that is not the job's (a job not in memory is looked up first)."""
        core = self.core
        if job is None:
            try:
                job = await core.lookup(a.job)
            except Exception as e:  # the store away: asked again at a later heartbeat
                log.warning("node %s runs job %s, which could not be looked up (%s)", node, a.job, e)
                self.asked.pop((node, a.job, a.attempt), None)
                return
            if job is not None and _current(job, node, a):
                return
        why = _why_not(job, a)
        self.ended += 1
        log.warning("node %s runs attempt %d of job %s, but %s: ending it there", node, a.attempt, a.job, why)
        try:
            reply = await commands.send(
                core, node, "control", Control(a.job, "end", by=why, attempt=a.attempt), ControlReply
            )
            if not reply.ok:
                log.warning("node %s did not end attempt %d of job %s: %s", node, a.attempt, a.job, reply.message)
        except bus.RequestError as e:  # asked again at a later heartbeat
            log.warning("node %s did not answer the end of attempt %d of job %s: %s", node, a.attempt, a.job, e)


def _current(job: Job, node: str, a: RunningAttempt) -> bool:
    s = job.status
    return s.state in ACTIVE_STATES and s.node == node and s.attempt == a.attempt


def _why_not(job: Job | None, a: RunningAttempt) -> str:
    """Why an attempt a node runs is not the job's, in words for both logs."""
    if job is None:
        return "there is no such job"
    s = job.status
    if s.state in TERMINAL_STATES:
        return f"the job ended ({s.state})"
    if s.attempt != a.attempt:
        where = f" on {s.node}" if s.node and s.state in ACTIVE_STATES else ""
        return f"the job's attempt is {s.attempt} ({s.state}{where})"
    if s.state in ACTIVE_STATES:
        return f"the job's attempt {s.attempt} is recorded on {s.node}"
    return f"the job is {s.state}: it was given back while this node was silent"
