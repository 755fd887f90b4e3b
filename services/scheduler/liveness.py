"""Which nodes are alive: heartbeats in, silent nodes out, and the jobs a gone or forgetful node held.

Silence is judged only against this scheduler's own proof that it hears the bus (its last lease renewal or any
node's heartbeat), and never across a stall of its own loop: a scheduler that was frozen or cut off gives every
node a fresh window instead of taking the whole fleet for gone."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from schemas import names, subject_parts
from schemas.events import StateChange
from schemas.job_status import ACTIVE_STATES
from schemas.nodes import Heartbeat
from schemas.validate import InvalidRequest, decoder_for
from services.aio import sleep_unless_stopped
from services.scheduler.attempts import Attempts
from services.scheduler.core import UNPLACED, Job, SchedulerCore
from services.scheduler.pausing import Pausing

log = logging.getLogger(__name__)
_heartbeat = decoder_for(Heartbeat)
_state = msgspec.json.Decoder(StateChange)
LAST_WORD_READ_S = 2.0  # reading a node's last state of a job from the stream
ON_ITS_WAY_S = 60.0  # a node's last word on a job, stored and not applied yet, is waited for while this recent


class Liveness:
    """Keeps the core's fleet from heartbeats, and gives back (or fails) the jobs of nodes gone silent."""

    def __init__(self, core: SchedulerCore, pausing: Pausing) -> None:
        self.core, self.pausing = core, pausing
        self.attempts = Attempts(core)

    async def on_heartbeat(self, msg) -> None:
        core = self.core
        try:
            hb = _heartbeat(msg.data)
        except InvalidRequest as e:
            log.warning("dropped a heartbeat on %s that did not decode: %s", msg.subject, e)
            return
        if hb.node != subject_parts.node_of_subject(msg.subject):
            log.warning("dropped a heartbeat for node %s sent on %s", hb.node, msg.subject)
            return
        if not core.may_act():  # a heartbeat buffered while this scheduler stalled past its lease: not ours to judge
            return
        core.awaited.pop(hb.node, None)
        core.heard_at = time.monotonic()  # proof that we hear the bus, as much as a lease renewal
        if core.fleet.heard(hb):
            core.wake.set()
        core.groups.node_heard(hb.node)
        self.attempts.compare(hb)  # before anything else runs: a job it takes back is held for it at once
        self._missing(hb)
        self.pausing.react_to_engines(hb)

    def _missing(self, hb: Heartbeat) -> None:
        """A job placed on the node that it does not run (its assignment or our record was lost) goes back to the
        queue once the node had time to take it up."""
        core = self.core
        grace = core.cfg.assign_timeout + 2 * core.cfg.heartbeat_interval
        now = time.monotonic()
        running = {(a.job, a.attempt) for a in hb.attempts}
        for job_id in list(core.by_node.get(hb.node, ())):
            job = core.jobs[job_id]
            s = job.status
            if (
                s.state in ACTIVE_STATES
                and (job_id, s.attempt) not in running
                and job_id not in hb.finished
                and now - job.assigned_at > grace
                and not job.suspect
            ):
                job.suspect = True
                core.spawn(self.lost(job, f"node {hb.node} is not running it", hb.node, s.attempt))

    async def watch(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        core = self.core
        tick = min(0.1, core.cfg.heartbeat_interval / 4)
        cut_off, last = False, time.monotonic()
        while not (stop.is_set() or lost.is_set()):
            await sleep_unless_stopped(stop, tick)
            now = time.monotonic()
            stalled, last = now - last - tick, now
            if not core.nc.is_connected:  # we hear nobody while we are cut off: that is not their silence
                cut_off = True
                continue
            if cut_off or stalled > core.cfg.window / 2:
                log.warning(
                    "%s: giving every node a fresh heartbeat window",
                    "reconnected" if cut_off else f"this scheduler's loop stalled for {stalled:.1f}s",
                )
                cut_off = False
                for view in core.fleet.nodes.values():
                    view.last_seen = now
                core.awaited = {n: now + core.cfg.window for n in core.awaited}
                continue
            horizon = min(now, max(core.connected_at, core.heard_at))  # silence counts up to our last proof that we
            # hear the bus: a lease renewal, or any node's heartbeat
            gone = core.fleet.silent_since(horizon - core.cfg.window)
            gone += [n for n, deadline in core.awaited.items() if deadline < horizon]
            for node in gone:
                await self._node_gone(node, now)

    async def _node_gone(self, node: str, now: float) -> None:
        core = self.core
        view = core.fleet.nodes.get(node)
        when = time.strftime("%H:%M:%S", time.localtime(view.last_seen_wall if view else time.time() - core.cfg.window))
        core.fleet.forget(node)
        core.groups.node_heard(node)
        self.attempts.forget_node(node)
        core.awaited.pop(node, None)
        log.warning("node %s stopped answering at %s", node, when)
        jobs = list(core.by_node.get(node, ()))
        results = await asyncio.gather(
            *(self.lost(core.jobs[j], f"node {node} stopped answering at {when}", node) for j in jobs),
            return_exceptions=True,
        )
        for job_id, r in zip(jobs, results):
            if isinstance(r, Exception):  # its record could not be written: memory still has it there; again soon
                log.warning("could not record the loss of job %s: %s", job_id, r)
                core.awaited[node] = now

    async def lost(self, job: Job, why: str, node: str, attempt: int | None = None) -> None:
        """A job whose node is gone (or forgot it): re-queue it while retries last, else fail it. Only if it is
        still that node's (and that attempt's): a later placement is not undone by a late verdict."""
        core = self.core
        async with job.lock:
            job.suspect = False
            s = job.status
            if s.state not in ACTIVE_STATES or s.node != node or (attempt is not None and s.attempt != attempt):
                return
            if await self._last_word_on_its_way(job, node):
                return
            never_ran = s.state == "assigned"
            used = s.retries_used
            if never_ran or used < job.stored.request.retries:
                used += 0 if never_ran else 1
                retry = "" if never_ran else f" (retry {used} of {job.stored.request.retries})"
                job.lost_from = (node, s.attempt, s.retries_used)  # the node may come back still running it
                await core.set_state_locked(job, "queued", f"{why}; re-queued{retry}", **UNPLACED, retries_used=used)
            else:
                await core.set_state_locked(job, "failed", why)

    async def _last_word_on_its_way(self, job: Job, node: str) -> bool:
        """Whether the node already said how the job's attempt ended (or that it paused, or handed it back) in a
        state stored in the stream that this scheduler has not applied yet: a heartbeat that no longer lists a job
        can come before its last state is read (a backlog of states in a burst, an agent that restarted and forgot
        what it finished). That job is not lost: its state ends it as the node said, and taking it for lost would
        place it a second time."""
        core, s = self.core, job.status
        subject = names.job(job.id, node, names.tenant_token(job.stored.tenant)).state
        try:
            msg = await asyncio.wait_for(core.js.get_last_msg(names.JOBS_STREAM, subject), LAST_WORD_READ_S)
            ev = _state.decode(msg.data or b"")
        except Exception:  # none stored, or the stream does not answer: the job is taken as lost, as before
            return False
        ended = ev.state not in ACTIVE_STATES
        if not ended or ev.attempt != s.attempt or (msg.seq or 0) <= s.event_seq or time.time() - ev.ts > ON_ITS_WAY_S:
            return False
        log.info(
            "job %s: node %s no longer lists it, but its %r is on its way; not taken for lost", job.id, node, ev.state
        )
        return True
