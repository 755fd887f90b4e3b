"""Which running jobs to preempt for one waiting job, and whether doing so frees something it can use (checked
before anyone is evicted, as Volcano simulates placement first).

A victim is a running job that has run --min-run-s, was not preempted within --preempt-backoff-s, and belongs to a
tenant the caller allows (over its share, or the waiting job's own tenant at a lower priority); all the victims of
one tenant for one waiting job are counted together, so that together they never take it below its share. What
it frees:
- a job alone on its device(s): the device, whose room once it stops (free memory plus what it was placed for,
  at most the device's total) must hold the waiting job;
- members of a co-training group the waiting job may join: the fewest members, least loss first, whose memory
  makes room for the job in the group, each of a tenant the caller allows (over its share), whatever tenant's
  job led the search to the group;
- a group the job may not join: the device, which needs every member to stop (all must be victims).
A job on several devices waits for that many on one node: victims accumulate per node until, with its free
devices, they make enough. Nothing on a node kept from the waiting job (for another's multi-device job) counts."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from schemas.co_train import group_key
from services.scheduler.submission_checks import held_mib
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.grouping import may_co_train, own_need
from services.scheduler.fleet import SlotKey
from services.scheduler.tenancy import Tenant

SCAN = 256  # running jobs looked at for one waiting job at most
SETTLING = 64  # of each priority's jobs started or checkpointed within --min-run-s, those looked at at most


@dataclass
class Plan:
    """The victims chosen for one waiting job, and the devices each victim tenant gives up."""

    waiting: Job
    victims: list[Job] = field(default_factory=list)
    frees: dict[Tenant, int] = field(default_factory=dict)
    claims: tuple[str, int] | None = None  # a multi-device job's node, and how many of its free devices it counts

    def add(self, victim: Job, devices: int) -> None:
        """One more victim, whose stopping takes `devices` from what its tenant holds."""
        self.victims.append(victim)
        tenant = victim.stored.tenant
        self.frees[tenant] = self.frees.get(tenant, 0) + devices


@dataclass
class OnNode:
    """A multi-device job's victims on one node so far: their devices there, and what each tenant gives up."""

    victims: list[Job] = field(default_factory=list)
    slots: set[SlotKey] = field(default_factory=set)
    gives: Counter[Tenant] = field(default_factory=Counter)


class VictimSearch:
    """Looks for victims for one waiting job among candidates given in preemption's order. Whatever the victims, a
    tenant's are checked together: `may_free(t, n)` is asked with all that t would give up for this job."""

    def __init__(
        self,
        core: SchedulerCore,
        waiting: Job,
        eligible: Callable[[Job], bool],
        kept: Container[str] = (),
        claimed: Mapping[str, int] | None = None,
    ) -> None:
        self.core, self.job, self.eligible = core, waiting, eligible
        self.claimed = claimed or {}  # node -> its free devices counted already for other waiting jobs' victims
        self.req = waiting.stored.request
        self.kinds = core.fleet.kinds(self.req.accelerator)
        self.kept = kept  # nodes kept for a multi-device job from this one: what frees there is not for it
        self.seen_groups: set[str] = set()
        self.on_node: dict[str, OnNode] = {}  # a multi-device job's victims by node

    def first(self, candidates: Iterable[str], may_free: Callable[[Tenant, int], bool]) -> Plan | None:
        """The first candidates (job ids, best victim first) that, stopped, free what the job needs; `may_free(t, n)`:
        whether tenant t may give up n devices for it (all it gives up, counted together)."""
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
        fitting = {s for s in slots if self.room(s, held_mib(self.core, s)) >= self.req.gpu_mib}
        if not fitting:
            return None
        if self.req.devices > 1:
            return self._gang(v, fitting, may_free)
        if not may_free(v.stored.tenant, len(slots)):
            return None
        plan = Plan(self.job)
        plan.add(v, len(slots))
        return plan

    def _gang(self, v: Job, fitting: set[SlotKey], may_free: Callable[[Tenant, int], bool]) -> Plan | None:
        """A multi-device job: victims add up per node with that node's free devices; a victim whose tenant, with
        the victims already chosen on that node, would fall below its share is passed over."""
        node, tenant = next(iter(fitting))[0], v.stored.tenant
        here = self.on_node.setdefault(node, OnNode())
        if not may_free(tenant, here.gives[tenant] + len(v.slots)):
            return None
        here.victims.append(v)
        here.slots |= fitting
        here.gives[tenant] += len(v.slots)
        free = len(self.core.fleet._fitting(node, self.req.gpu_mib, self.kinds)) - self.claimed.get(node, 0)
        if free + len(here.slots) < self.req.devices:
            return None
        plan = Plan(self.job, claims=(node, max(0, self.req.devices - len(here.slots))))
        for each in here.victims:
            plan.add(each, len(each.slots))
        return plan

    def _group(self, v: Job, group: str, may_free: Callable[[Tenant, int], bool]) -> Plan | None:
        core = self.core
        g = core.groups.by_id.get(group)
        if g is None or self.req.devices > 1:
            return None
        members = [core.jobs[j] for j in g.members if j in core.jobs]
        if self.may_join(g.key, g.tenant, g.slot[0]):  # the fewest members whose memory makes room for it
            return self._room_in(g, members, may_free)
        tenants = {m.stored.tenant for m in members}
        if not all(self.eligible(m) for m in members) or not all(may_free(t, 1) for t in tenants):
            return None  # the device frees only when every member stops
        if self.room(g.slot, held_mib(core, g.slot)) < self.req.gpu_mib:
            return None
        plan = Plan(self.job)
        for m in members:  # each tenant gives up the device once
            plan.add(m, 0 if m.stored.tenant in plan.frees else 1)
        return plan

    def _room_in(self, g, members: list[Job], may_free: Callable[[Tenant, int], bool]) -> Plan | None:
        """The fewest members, least loss first, whose memory makes room for the job in the group, each of a tenant
        that may give it up: the device, when none of that tenant's jobs stays in the group; else none of its
        devices, but it must still be over its share (may_free(t, 0))."""
        core = self.core
        need, room = own_need(self.req, core.fleet, g.slot), self.room(g.slot, 0)
        plan, chosen = Plan(self.job), Counter[Tenant]()
        for m in sorted((m for m in members if self.eligible(m)), key=self._order):
            if room >= need:
                break
            tenant = m.stored.tenant
            gives = 1 if core.tenant_slots[(tenant, g.slot)] <= chosen[tenant] + 1 else 0
            if not may_free(tenant, plan.frees.get(tenant, 0) + gives):
                continue
            chosen[tenant] += 1
            plan.add(m, gives)
            room += g.members.get(m.id, m.stored.request.gpu_mib)
        return plan if plan.victims and room >= need else None

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
        if view is None or dev is None or view.heartbeat.draining or dev.failed or dev.reclaim_mib or node in self.kept:
            return -1
        if dev.kind not in self.kinds:
            return -1
        return min(dev.total_mib, dev.free_mib + freed_mib)


class Cursors:
    """Each victim tenant's running jobs in preemption's order, read on across one check's waiting jobs: one that
    may not be preempted now (a victim already, too young, preempted lately) is passed over once per check; one that
    may, but did not fit a waiting job, is offered to the next again."""

    def __init__(self, core: SchedulerCore, settled: float, eligible: Callable[[str], bool]) -> None:
        self.core, self.settled, self.eligible = core, settled, eligible
        self._read: dict[Tenant, Iterator[str]] = {}
        self._kept: dict[Tenant, list[str]] = {}

    def of(self, tenant: Tenant) -> Iterator[str]:
        if tenant not in self._read:
            self._read[tenant] = self.core.book.running.of(tenant, settled=self.settled, scan=SETTLING)
            self._kept[tenant] = []
        kept = self._kept[tenant]
        kept[:] = [j for j in kept if self.eligible(j)]
        yield from list(kept)
        for job in self._read[tenant]:
            if self.eligible(job):
                kept.append(job)
                yield job

    def own(self, tenant: Tenant, below: int, node: str | None = None) -> Iterator[str]:
        """The tenant's own running jobs of a priority below `below` (on `node` alone, when given), afresh: a swap
        is rare."""
        if node is not None:
            return self.on_node(tenant, node, below)
        return self.core.book.running.of(tenant, below=below, settled=self.settled, scan=SETTLING)

    def on_node(self, tenant: Tenant, node: str, below: int | None = None) -> Iterator[str]:
        """The tenant's running jobs on one node (of a priority below `below`, when given), in preemption's order:
        for a job pinned there, as many as the node's devices hold, never the tenant's whole list."""
        running = self.core.book.running.jobs
        here = [
            j
            for j in self.core.by_node.get(node, ())
            if (e := running.get(j)) is not None and e.tenant == tenant and (below is None or e.priority < below)
        ]
        here.sort(key=lambda j: (running[j].priority, -running[j].anchor))
        return iter(here)
