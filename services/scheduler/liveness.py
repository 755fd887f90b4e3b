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
from services.scheduler.core import UNPLACED, Job
from services.scheduler.pausing import SchedulerPausing

log = logging.getLogger(__name__)
_heartbeat = decoder_for(Heartbeat)


class SchedulerLiveness(SchedulerPausing):
    async def _on_heartbeat(self, msg) -> None:
        try:
            hb = _heartbeat(msg.data)
        except InvalidRequest as e:
            log.warning("dropped a heartbeat on %s that did not decode: %s", msg.subject, e)
            return
        if hb.node != names.node_of_subject(msg.subject):
            log.warning("dropped a heartbeat for node %s sent on %s", hb.node, msg.subject)
            return
        self.awaited.pop(hb.node, None)
        if self.fleet.heard(hb):
            self._wake.set()
        self._reconcile(hb)
        self._react_to_engines(hb)

    def _reconcile(self, hb: Heartbeat) -> None:
        """An assignment the node never took up (its reply or our record was lost) goes back to the queue."""
        grace = self.cfg.assign_timeout + 2 * self.cfg.heartbeat_interval
        now = time.monotonic()
        running = set(hb.running) | set(hb.finished)
        for job_id in list(self.by_node.get(hb.node, ())):
            job = self.jobs[job_id]
            if (job.status.state in ACTIVE_STATES and job_id not in running and now - job.assigned_at > grace
                    and not job.suspect):
                job.suspect = True
                self._spawn(self._lost(job, f"node {hb.node} is not running it"))

    async def _watch_liveness(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        tick = min(0.1, self.cfg.heartbeat_interval / 4)
        cut_off = False
        while not (stop.is_set() or lost.is_set()):
            await sleep_unless_stopped(stop, tick)
            now = time.monotonic()
            if not self.nc.is_connected:  # we hear nobody while we are cut off: that is not their silence
                cut_off = True
                continue
            if cut_off:
                cut_off = False
                log.info("reconnected: giving every node a fresh heartbeat window")
                for view in self.fleet.nodes.values():
                    view.last_seen = now
                self.awaited = {n: now + self.cfg.window for n in self.awaited}
                continue
            gone = self.fleet.silent_since(now - self.cfg.window)
            gone += [n for n, deadline in self.awaited.items() if deadline < now]
            for node in gone:
                await self._node_gone(node, now)

    async def _node_gone(self, node: str, now: float) -> None:
        view = self.fleet.nodes.get(node)
        when = time.strftime("%H:%M:%S", time.localtime(view.last_seen_wall if view else time.time() - self.cfg.window))
        self.fleet.forget(node)
        self.awaited.pop(node, None)
        log.warning("node %s stopped answering at %s", node, when)
        jobs = list(self.by_node.pop(node, ()))
        results = await asyncio.gather(*(self._lost(self.jobs[j], f"node {node} stopped answering at {when}")
                                         for j in jobs), return_exceptions=True)
        for job_id, r in zip(jobs, results):
            if isinstance(r, Exception):  # its record could not be written: try again next tick
                log.warning("could not record the loss of job %s: %s", job_id, r)
                self.by_node.setdefault(node, set()).add(job_id)
                self.awaited[node] = now

    async def _lost(self, job: Job, why: str) -> None:
        """A job whose node is gone (or forgot it): re-queue it while retries last, else fail it."""
        async with job.lock:
            job.suspect = False
            if job.status.state not in ACTIVE_STATES:
                return
            never_ran = job.status.state == "assigned"
            used = job.status.retries_used
            if never_ran or used < job.stored.request.retries:
                used += 0 if never_ran else 1
                retry = "" if never_ran else f" (retry {used} of {job.stored.request.retries})"
                if await self._set_state_locked(job, "queued", f"{why}; re-queued{retry}", **UNPLACED,
                                                retries_used=used):
                    self._enqueue(job)
            else:
                await self._set_state_locked(job, "failed", why)
