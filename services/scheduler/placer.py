"""The placement loop: take queued jobs that fit free devices, record each assignment, hand it to its node."""

from __future__ import annotations

import asyncio
import logging


from schemas import names
from schemas.nodes import Assignment, AssignRefused, AssignReply, on_devices
from services import bus
from services.aio import wait_first
from services.scheduler.config import engine_priority
from services.scheduler.core import Job, SchedulerCore

log = logging.getLogger(__name__)


class Placer:
    """Places the core's queued jobs on free devices, one pass each time something may have freed or arrived."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core

    async def run(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        core = self.core

        async def wake_on_end():
            await wait_first(stop, lost)
            core.wake.set()

        ender = asyncio.create_task(wake_on_end())
        try:
            while not (stop.is_set() or lost.is_set()):
                await core.wake.wait()
                core.wake.clear()
                self.place_pass()
                await asyncio.sleep(0)  # let heartbeats and submissions in between passes
        finally:
            ender.cancel()

    def place_pass(self) -> None:
        core = self.core
        holding = self._devices_by_tenant()
        kept_nodes = core.gang_holds = {
            n: j
            for n, j in core.gang_holds.items()
            if j in core.queue and n in core.fleet.nodes and not core.fleet.nodes[n].heartbeat.draining
        }

        def kept_from(job_id: str, priority: int) -> set[str]:
            """Nodes kept for a waiting multi-device job this one may not pass (it has no higher priority)."""
            return {
                n for n, j in kept_nodes.items() if j != job_id and core.jobs[j].stored.request.priority >= priority
            }

        def fits(node=None):
            def try_place(job_id: str) -> bool:
                job = core.jobs[job_id]
                if job.lock.locked() or job_id in core.unsure or job.placing:  # being written, or read back
                    return False
                req, tenant = job.stored.request, job.stored.tenant
                if self._device_quota_full(holding, tenant, req.devices):
                    return False  # the tenant holds its quota of devices: the job waits, others pass it
                kept = kept_from(job_id, req.priority)
                if node is not None and node in kept:
                    return False
                if req.devices == 1:
                    slot = core.fleet.find(req.gpu_mib, req.accelerator, node, kept)
                    slots = [slot] if slot else None
                else:
                    slots = core.fleet.find_gang(req.gpu_mib, req.accelerator, req.devices, node, kept)
                    if slots is None:
                        self._keep_for_gang(job_id, node, kept)
                if not slots:
                    return False
                core.hold_for(job, slots)  # held while the assignment is written, so no other pass takes them
                kept_nodes.pop(next((n for n, j in kept_nodes.items() if j == job_id), ""), None)
                holding[tenant] = holding.get(tenant, 0) + len(slots)
                return True

            return try_place

        for node in core.queue.pinned_nodes():
            for job_id in core.queue.take(fits(node), node=node, window=core.cfg.backfill_window):
                core.spawn(self._assign(core.jobs[job_id]))
        if core.fleet.any_free():
            for job_id in core.queue.take(fits(), window=core.cfg.backfill_window):
                core.spawn(self._assign(core.jobs[job_id]))
                if not core.fleet.any_free():
                    break

    def _device_quota_full(self, holding: dict, tenant: str | None, devices: int) -> bool:
        """Whether `devices` more would take the tenant past its device quota (holding: what each holds now)."""
        limit = self.core.cfg.quota(tenant).devices
        return limit is not None and holding.get(tenant, 0) + devices > limit

    def _keep_for_gang(self, job_id: str, node: str | None, kept: set[str]) -> None:
        """A multi-device job that does not fit yet has a node kept for it: jobs behind it in the queue are
        placed elsewhere, so devices freeing there one by one add up to its gang instead of going to small jobs
        forever."""
        core = self.core
        if job_id in core.gang_holds.values():
            return
        req = core.jobs[job_id].stored.request
        home = (
            node
            if node is not None
            else core.fleet.gang_home(req.gpu_mib, req.accelerator, req.devices, kept | set(core.gang_holds))
        )
        if home is not None and home not in core.gang_holds:
            core.gang_holds[home] = job_id
            log.info("node %s is kept for job %s, which needs %d devices there", home, job_id, req.devices)

    def _devices_by_tenant(self) -> dict[str | None, int]:
        """Devices each tenant's jobs hold now (counted as their states change)."""
        return {t: n for t, n in self.core.devices_by_tenant.items() if t is not None and n}

    async def _assign(self, job: Job) -> None:
        """Record the placement, then hand the job to its node. Until the record is stored the devices are held
        for the job (job.placing); a write that fails leaves the job queued, as the store has it."""
        core = self.core
        slots = job.placing or []
        node, device = slots[0]
        attempt = job.status.attempt + 1
        devices = [i for _, i in slots] if len(slots) > 1 else []
        try:
            written = await core.set_state(
                job,
                "assigned",
                f"assigned to {node} {on_devices([i for _, i in slots])}",
                attempt=attempt,
                node=node,
                device=device,
                devices=devices,
                held_by=[*job.status.held_by, node][-100:],
                when=lambda s: s.state == "queued",
            )
        except Exception as e:  # JetStream away or deposed: the job stays as the store has it
            log.warning("could not record the assignment of %s (%s: %s)", job.id, type(e).__name__, e)
            written = False
        finally:
            core.unhold(job)  # not placed after all: it keeps its place in the queue
        if written:
            await self._hand_over(job, node, device, devices, attempt)

    async def _hand_over(self, job: Job, node: str, device: int, devices: list[int], attempt: int) -> None:
        core = self.core
        try:
            request = core.take_cached_request(job.id) or (await core.store.request(job.id)).request
            reply = await bus.request(
                core.nc,
                names.node(node).assign,
                Assignment(
                    job=job.id,
                    device=device,
                    devices=devices,
                    attempt=attempt,
                    request=request,
                    resume_from=job.status.checkpoint,
                    tenant=job.stored.tenant,
                    engine_priority=engine_priority(job.stored),
                ),
                AssignReply,
                timeout=core.cfg.assign_timeout,
            )
        except bus.RequestError as e:
            reply = AssignRefused(job.id, str(e))
        if isinstance(reply, AssignRefused):
            log.info("node %s refused job %s: %s; re-queued", node, job.id, reply.reason)
            try:
                await core.requeue(
                    job,
                    f"node {node} refused it ({reply.reason}); waiting for a device",
                    when=lambda s: s.state == "assigned" and s.attempt == attempt,
                )
            except Exception as e:  # the node lists no such attempt: liveness gives it back after the grace
                log.warning("could not re-queue %s after its node refused it: %s", job.id, e)
