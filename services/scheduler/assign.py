"""The placement loop: take queued jobs that fit free devices, record each assignment, hand it to its node."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from schemas import names
from schemas.jobs import ACTIVE_STATES
from schemas.nodes import Assignment, AssignRefused, AssignReply
from services import bus
from services.aio import wait_first
from services.scheduler.core import Job, SchedulerCore

log = logging.getLogger(__name__)


class SchedulerAssign(SchedulerCore):
    async def _placer(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        async def wake_on_end():
            await wait_first(stop, lost)
            self._wake.set()

        ender = asyncio.create_task(wake_on_end())
        try:
            while not (stop.is_set() or lost.is_set()):
                await self._wake.wait()
                self._wake.clear()
                self._place_pass()
                await asyncio.sleep(0)  # let heartbeats and submissions in between passes
        finally:
            ender.cancel()

    def _place_pass(self) -> None:
        holding = self._devices_by_tenant()

        def fits(node=None):
            def try_place(job_id: str) -> bool:
                job = self.jobs[job_id]
                req, tenant = job.stored.request, job.stored.tenant
                limit = self.cfg.quota(tenant).devices
                if limit is not None and holding.get(tenant, 0) >= limit:
                    return False  # the tenant holds its quota of devices: the job waits, others pass it
                slot = self.fleet.find(req.gpu_mib, req.accelerator, node)
                if slot is None:
                    return False
                self.fleet.reserve(slot, job_id)
                holding[tenant] = holding.get(tenant, 0) + 1
                job.status = msgspec.structs.replace(job.status, node=slot[0], device=slot[1])
                return True
            return try_place

        for node in self.queue.pinned_nodes():
            for job_id in self.queue.take(fits(node), node=node, window=self.cfg.backfill_window):
                self._spawn(self._assign(self.jobs[job_id]))
        if self.fleet.any_free():
            for job_id in self.queue.take(fits(), window=self.cfg.backfill_window):
                self._spawn(self._assign(self.jobs[job_id]))
                if not self.fleet.any_free():
                    break

    def _devices_by_tenant(self) -> dict[str | None, int]:
        """Devices each tenant's jobs hold now; counted only when some quota limits devices."""
        if self.cfg.default_quota.devices is None and all(q.devices is None for q in self.cfg.quotas.values()):
            return {}
        holding: dict[str | None, int] = {}
        for job in self.jobs.values():
            if job.stored.tenant is not None and job.status.state in ACTIVE_STATES:
                holding[job.stored.tenant] = holding.get(job.stored.tenant, 0) + 1
        return holding

    async def _assign(self, job: Job) -> None:
        node, device = job.slot
        attempt = job.status.attempt + 1
        self.by_node.setdefault(node, set()).add(job.id)
        job.assigned_at = time.monotonic()
        try:
            written = await self._set_state(job, "assigned", f"assigned to {node} device {device}", attempt=attempt,
                                            when=lambda s: s.state == "queued")
        except Exception as e:  # JetStream away: the job stays queued, the slot free
            log.warning("could not record the assignment of %s (%s); it stays queued", job.id, e)
            written = False
            job.status = msgspec.structs.replace(job.status, node=None, device=None)
            self._enqueue(job)
        if not written:
            self.fleet.release((node, device), job.id)
            return
        try:
            request = self._full_request_cached(job.id) or (await self.store.request(job.id)).request
            reply = await bus.request(self.nc, names.node(node).assign,
                                      Assignment(job=job.id, device=device, attempt=attempt, request=request,
                                                 resume_from=job.status.checkpoint, tenant=job.stored.tenant),
                                      AssignReply, timeout=self.cfg.assign_timeout)
        except bus.RequestError as e:
            reply = AssignRefused(job.id, str(e))
        if isinstance(reply, AssignRefused):
            log.info("node %s refused job %s: %s; re-queued", node, job.id, reply.reason)
            await self._requeue(job, f"node {node} refused it ({reply.reason}); waiting for a device",
                                when=lambda s: s.state == "assigned" and s.attempt == attempt)
