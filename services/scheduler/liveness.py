"""Which nodes are alive: heartbeats in, silent nodes out, and the jobs a gone or forgetful node held."""

from __future__ import annotations

import asyncio
import logging
import time

from schemas import names
from schemas.jobs import ACTIVE_STATES
from schemas.nodes import Heartbeat
from schemas.validate import InvalidRequest, decoder_for
from services.aio import sleep_unless_stopped
from services.scheduler.core import UNPLACED, Job, SchedulerCore
from services.scheduler.pausing import Pausing

log = logging.getLogger(__name__)
_heartbeat = decoder_for(Heartbeat)


class Liveness:
    """Keeps the core's fleet from heartbeats, and gives back (or fails) the jobs of nodes gone silent."""

    def __init__(self, core: SchedulerCore, pausing: Pausing) -> None:
        self.core, self.pausing = core, pausing

    async def on_heartbeat(self, msg) -> None:
        core = self.core
        try:
            hb = _heartbeat(msg.data)
        except InvalidRequest as e:
            log.warning("dropped a heartbeat on %s that did not decode: %s", msg.subject, e)
            return
        if hb.node != names.node_of_subject(msg.subject):
            log.warning("dropped a heartbeat for node %s sent on %s", hb.node, msg.subject)
            return
        core.awaited.pop(hb.node, None)
        if core.fleet.heard(hb):
            core.wake.set()
        self._reconcile(hb)
        self.pausing.react_to_engines(hb)

    def _reconcile(self, hb: Heartbeat) -> None:
        """An assignment the node never took up (its reply or our record was lost) goes back to the queue."""
        core = self.core
        grace = core.cfg.assign_timeout + 2 * core.cfg.heartbeat_interval
        now = time.monotonic()
        running = set(hb.running) | set(hb.finished)
        for job_id in list(core.by_node.get(hb.node, ())):
            job = core.jobs[job_id]
            if (
                job.status.state in ACTIVE_STATES
                and job_id not in running
                and now - job.assigned_at > grace
                and not job.suspect
            ):
                job.suspect = True
                core.spawn(self._lost(job, f"node {hb.node} is not running it"))

    async def watch(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        core = self.core
        tick = min(0.1, core.cfg.heartbeat_interval / 4)
        cut_off = False
        while not (stop.is_set() or lost.is_set()):
            await sleep_unless_stopped(stop, tick)
            now = time.monotonic()
            if not core.nc.is_connected:  # we hear nobody while we are cut off: that is not their silence
                cut_off = True
                continue
            if cut_off:
                cut_off = False
                log.info("reconnected: giving every node a fresh heartbeat window")
                for view in core.fleet.nodes.values():
                    view.last_seen = now
                core.awaited = {n: now + core.cfg.window for n in core.awaited}
                continue
            gone = core.fleet.silent_since(now - core.cfg.window)
            gone += [n for n, deadline in core.awaited.items() if deadline < now]
            for node in gone:
                await self._node_gone(node, now)

    async def _node_gone(self, node: str, now: float) -> None:
        core = self.core
        view = core.fleet.nodes.get(node)
        when = time.strftime("%H:%M:%S", time.localtime(view.last_seen_wall if view else time.time() - core.cfg.window))
        core.fleet.forget(node)
        core.awaited.pop(node, None)
        log.warning("node %s stopped answering at %s", node, when)
        jobs = list(core.by_node.pop(node, ()))
        results = await asyncio.gather(
            *(self._lost(core.jobs[j], f"node {node} stopped answering at {when}") for j in jobs),
            return_exceptions=True,
        )
        for job_id, r in zip(jobs, results):
            if isinstance(r, Exception):  # its record could not be written: try again next tick
                log.warning("could not record the loss of job %s: %s", job_id, r)
                core.by_node.setdefault(node, set()).add(job_id)
                core.awaited[node] = now

    async def _lost(self, job: Job, why: str) -> None:
        """A job whose node is gone (or forgot it): re-queue it while retries last, else fail it."""
        core = self.core
        async with job.lock:
            job.suspect = False
            if job.status.state not in ACTIVE_STATES:
                return
            never_ran = job.status.state == "assigned"
            used = job.status.retries_used
            if never_ran or used < job.stored.request.retries:
                used += 0 if never_ran else 1
                retry = "" if never_ran else f" (retry {used} of {job.stored.request.retries})"
                if await core.set_state_locked(
                    job, "queued", f"{why}; re-queued{retry}", **UNPLACED, retries_used=used
                ):
                    core.enqueue(job)
            else:
                await core.set_state_locked(job, "failed", why)
