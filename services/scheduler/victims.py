"""Which running jobs to preempt for one waiting job, and whether doing so frees something it can use (checked
before anyone is evicted, as Volcano simulates placement first).

A victim is a running job that has run --min-run-s, was not preempted within --preempt-backoff-s, and belongs to a
tenant the caller allows (over its share, or the waiting job's own tenant at a lower priority). What it frees:
- a job alone on its device(s): the device, whose room once it stops (free memory plus what it was placed for,
  at most the device's total) must hold the waiting job;
- members of a co-training group the waiting job may join: the fewest members, least loss first, whose memory
  makes room for the job in the group;
- a group the job may not join: the device, which needs every member to stop (all must be victims).
A job on several devices waits for that many on one node: victims accumulate per node until, with its free
devices, they make enough."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from schemas.co_train import group_key
from services.scheduler.submission_checks import held_mib
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.grouping import may_co_train, own_need
from services.scheduler.fleet import SlotKey
from services.scheduler.tenancy import Tenant

SCAN = 256  # running jobs looked at for one waiting job at most


@dataclass
class Plan:
    """The victims chosen for one waiting job, and the devices each victim tenant gives up."""

    waiting: Job
    victims: list[Job] = field(default_factory=list)
    frees: dict[Tenant, int] = field(default_factory=dict)

    def add(self, victims: Iterable[Job], devices: int) -> None:
        for v in victims:
            self.victims.append(v)
        tenants = {v.stored.tenant for v in victims}
        for t in tenants:
            self.frees[t] = self.frees.get(t, 0) + devices


class VictimSearch:
    """Looks for victims for one waiting job among candidates given in preemption's order."""

    def __init__(self, core: SchedulerCore, waiting: Job, eligible: Callable[[Job], bool]) -> None:
        self.core, self.job, self.eligible = core, waiting, eligible
        self.req = waiting.stored.request
        self.kinds = core.fleet.kinds(self.req.accelerator)
        self.seen_groups: set[str] = set()
        self.on_node: dict[str, tuple[list[Job], set[SlotKey]]] = {}  # a multi-device job's victims by node

    def first(self, candidates: Iterable[str], may_free: Callable[[Tenant, int], bool]) -> Plan | None:
        """The first candidates (job ids, best victim first) that, stopped, free what the job needs; `may_free(t, n)`:
        whether tenant t may give up n more devices."""
        core, looked = self.core, 0
        for job_id in candidates:
            looked += 1
            if looked > SCAN:
                return None
            v = core.jobs.get(job_id)
            if v is None or not self.eligible(v):
                continue
            plan = self._consider(v, may_free)
            if plan is not None:
                return plan
        return None

    def _consider(self, v: Job, may_free: Callable[[Tenant, int], bool]) -> Plan | None:
        group = v.status.group
        if group is not None:
            if group in self.seen_groups:
                return None
            self.seen_groups.add(group)
            return self._group(v, group, may_free)
        slots = v.slots
        if not may_free(v.stored.tenant, len(slots)):
            return None
        fitting = {s for s in slots if self.room(s, held_mib(self.core, s)) >= self.req.gpu_mib}
        if not fitting:
            return None
        if self.req.devices == 1:
            plan = Plan(self.job)
            plan.add([v], len(slots))
            return plan
        return self._gang(v, fitting)

    def _gang(self, v: Job, fitting: set[SlotKey]) -> Plan | None:
        """A multi-device job: victims add up per node with that node's free devices."""
        node = next(iter(fitting))[0]
        victims, slots = self.on_node.setdefault(node, ([], set()))
        victims.append(v)
        slots |= fitting
        free = len(self.core.fleet._fitting(node, self.req.gpu_mib, self.kinds))
        if free + len(slots) < self.req.devices:
            return None
        plan = Plan(self.job)
        for each in victims:
            plan.add([each], len(each.slots))
        return plan

    def _group(self, v: Job, group: str, may_free: Callable[[Tenant, int], bool]) -> Plan | None:
        core = self.core
        g = core.groups.by_id.get(group)
        if g is None or self.req.devices > 1:
            return None
        members = [core.jobs[j] for j in g.members if j in core.jobs]
        if self.may_join(g.key, g.tenant, g.slot[0]):  # the fewest members whose memory makes room for it
            need, room = own_need(self.req, core.fleet, g.slot), self.room(g.slot, 0)
            chosen: list[Job] = []
            for m in sorted((m for m in members if self.eligible(m)), key=self._order):
                if room >= need:
                    break
                chosen.append(m)
                room += g.members.get(m.id, m.stored.request.gpu_mib)
            if chosen and room >= need:
                plan = Plan(self.job)
                plan.add(chosen, 0)  # the group keeps its device
                return plan
            return None
        if not all(self.eligible(m) for m in members) or not all(may_free(m.stored.tenant, 1) for m in members):
            return None  # the device frees only when every member stops
        if self.room(g.slot, held_mib(core, g.slot)) < self.req.gpu_mib:
            return None
        plan = Plan(self.job)
        plan.add(members, 1)
        return plan

    def may_join(self, key, tenant: Tenant, node: str) -> bool:
        """Whether the waiting job could train in a group of this kind (its base, precision, the policy's tenants)."""
        core, req = self.core, self.req
        if self.job.status.train_alone or not may_co_train(core.cfg, req):
            return False
        if core.cfg.co_train == "same-tenant" and tenant != self.job.stored.tenant:
            return False
        return group_key(req, core.fleet.model_shape(req.base_dir, node)) == key

    def _order(self, m: Job) -> tuple[int, float]:
        entry = self.core.book.running.jobs.get(m.id)
        return (m.stored.request.priority, -(entry.anchor if entry else time.time()))

    def room(self, slot: SlotKey, freed_mib: int) -> int:
        """The memory the device would have for the waiting job once `freed_mib` goes back; -1: not for it."""
        node, index = slot
        if self.req.node is not None and node != self.req.node:
            return -1
        view = self.core.fleet.nodes.get(node)
        dev = view.devices.get(index) if view else None
        if view is None or dev is None or view.heartbeat.draining or dev.failed or dev.reclaim_mib:
            return -1
        if dev.kind not in self.kinds:
            return -1
        return min(dev.total_mib, dev.free_mib + freed_mib)
