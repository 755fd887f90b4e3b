"""The placement loop: take queued jobs that fit free devices, record each assignment, hand it to its node."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from schemas.co_train import founds_alone
from schemas.nodes import Assignment, AssignRefused, AssignReply, on_devices
from services import bus
from services.aio import wait_first
from services.scheduler import commands, gc_pauses, grouping, sharing
from services.scheduler.config import engine_priority
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.pass_stats import PassStats
from services.scheduler.queue import JobQueue
from services.scheduler.sharing import ShareTable
from services.scheduler.tenancy import Tenant

log = logging.getLogger(__name__)
PASS_STOP_S = 0.008  # it stops placing once past this: the job it tries then (a gang's best fit, up to a ms at
# 1,000 nodes) still ends within the budget
KEPT_PER_NODES = 16  # one node of this many at most is kept for waiting multi-device jobs at once: with a node kept
# for each of 500 waiting gangs (bench/fair_share.py's mix), a third of the fleet stood draining and utilisation while
# jobs waited fell to 78%; a kept node serves a gang each time it drains


class Placer:
    """Places the core's queued jobs on free devices, one pass each time something may have freed or arrived."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.stats = PassStats()
        self.unanswered = core.unanswered  # nodes resting after unanswered assignments (`why` says it too)

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
                if core.may_act():
                    self.place_pass()
                await asyncio.sleep(0)  # let heartbeats, submissions and the lease in between passes
        finally:
            ender.cancel()

    def place_pass(self) -> None:
        """Place what fits, for at most PASS_BUDGET_S: a pass cut short wakes the next one, which goes on after
        whatever else waits for the loop (a lease renewal, heartbeats, submissions). Under fair sharing the tenants'
        queues take turns in the order of their shares (PlacementPass.rounds)."""
        core, placing = self.core, PlacementPass(self)
        started, collected, cpu = time.perf_counter(), gc_pauses.spent_s(), time.thread_time()
        collecting = gc_pauses.hold_off()  # no collection lands in the pass: it comes after it
        try:
            # jobs pinned to a node that has no free device and no co-training group wait, costing nothing (as
            # do those pinned to a node nobody has heard of)
            open_nodes = grouping.EitherNodes(core.fleet.free_nodes(), core.groups.on_node.keys())
            for tenant, queue, within_share in placing.rounds():
                if not (core.fleet.any_free() or core.groups.by_id):
                    return
                limit = placing.table.share.get(tenant, 0) if within_share and placing.table else None
                # a tenant's jobs pinned to a node take its turn (and its share) as its others do, before them
                for node in [*queue.pinned_nodes(among=open_nodes), None]:
                    if not self._place(placing, queue, tenant, node, started, limit):
                        return
        finally:
            self.stats.passed(time.perf_counter() - started, gc_pauses.spent_s() - collected, time.thread_time() - cpu)
            gc_pauses.let_go(collecting)

    def _place(
        self,
        placing: PlacementPass,
        queue: JobQueue,
        tenant: Tenant,
        node: str | None,
        started: float,
        limit: int | None = None,
    ) -> bool:
        """Place the queue's jobs (those pinned to `node`, or the rest) while they fit (and, with `limit`, while
        the tenant holds fewer devices than that); False when the pass ran out of its time (the next pass goes on)."""
        core = self.core
        placing.limit = limit
        cut = False

        def until() -> bool:  # the tenant has its share for this turn; or the pass placed jobs and ran out of time
            nonlocal cut
            cut = placing.placed > 0 and time.perf_counter() - started > PASS_STOP_S
            return cut or (limit is not None and placing.holding.get(tenant, 0) >= limit)

        with contextlib.closing(
            queue.take(placing.fits(node), node=node, window=core.cfg.backfill_window, until=until)
        ) as jobs:
            for job_id in jobs:
                placing.placed += 1
                core.spawn(self._assign(core.jobs[job_id], placing.needs.get(job_id)))
                if node is None and not core.fleet.any_free() and not core.groups.by_id:
                    break
                if time.perf_counter() - started > PASS_STOP_S:
                    cut = True
                    break
        if cut:  # the next pass goes on after whatever else waits for the loop
            core.wake.set()
        return not cut

    def _keep_for_gang(self, placing: PlacementPass, job_id: str, node: str | None, kept: frozenset[str]) -> None:
        """A multi-device job that does not fit yet has a node kept for it: jobs behind it in the queue are
        placed elsewhere, so devices freeing there one by one add up to its gang instead of going to small jobs
        forever."""
        core = self.core
        if job_id in placing.kept_for:
            return
        req = core.jobs[job_id].stored.request
        shape = (req.gpu_mib, req.accelerator, req.devices)
        if node is None and shape in placing.homeless:
            return  # no node is left for a gang of this shape in this pass: the next one looks again
        if len(core.gang_holds) >= max(1, len(core.fleet.nodes) // KEPT_PER_NODES):
            return  # the devices freeing on kept nodes stand idle until their gang starts: a few nodes at once
        home = (
            node
            if node is not None
            else core.fleet.gang_home(req.gpu_mib, req.accelerator, req.devices, kept | core.gang_holds.keys())
        )
        if home is None:
            placing.homeless.add(shape)
        elif home not in core.gang_holds:
            core.gang_holds[home] = job_id
            placing.kept_for[job_id] = home
            placing.kept.changed()
            log.info("node %s is kept for job %s, which needs %d devices there", home, job_id, req.devices)

    async def _assign(self, job: Job, need_mib: int | None) -> None:
        """Record the placement, then hand the job to its node. Until the record is stored the devices are held
        for the job (job.placing); a write that fails leaves the job queued, as the store has it."""
        core = self.core
        slots, group = job.placing or [], job.placing_group
        node, device = slots[0]
        attempt = job.status.attempt + 1
        devices = [i for _, i in slots] if len(slots) > 1 else []
        try:
            written = await core.set_state(
                job,
                "assigned",
                f"assigned to {node} {on_devices([i for _, i in slots])}"
                + (f" in co-training group {group}" if group else ""),
                attempt=attempt,
                node=node,
                device=device,
                devices=devices,
                group=group,
                held_by=[*job.status.held_by, node][-100:],
                preempted="",
                when=lambda s: s.state == "queued",
            )
        except Exception as e:  # JetStream away or deposed: the job stays as the store has it
            log.warning("could not record the assignment of %s (%s: %s)", job.id, type(e).__name__, e)
            written = False
        finally:
            core.unhold(job)  # not placed after all: it keeps its place in the queue
        if written:
            await self._hand_over(job, node, device, devices, attempt, need_mib)

    async def _hand_over(
        self, job: Job, node: str, device: int, devices: list[int], attempt: int, need_mib: int | None
    ) -> None:
        core, sent = self.core, time.monotonic()
        try:
            request = core.requests.take(job.id) or (await core.store.request(job.id)).request
            reply = await commands.send(
                core,
                node,
                "assign",
                Assignment(
                    job=job.id,
                    device=device,
                    devices=devices,
                    attempt=attempt,
                    request=request,
                    resume_from=job.status.checkpoint,
                    tenant=job.stored.tenant,
                    engine_priority=engine_priority(job.stored),
                    group=job.status.group,
                    need_mib=need_mib,
                ),
                AssignReply,
            )
        except bus.RequestError as e:  # sent and not answered: the node rests a while (unanswered.py)
            why = self.unanswered.no_answer(job.id, node, e, sent) if core.may_act() else str(e)
            reply = AssignRefused(job.id, why)
        else:
            self.unanswered.answered(node)
        if isinstance(reply, AssignRefused) and not core.may_act():
            return  # not sent, or refused as a deposed leader's: the next leader places the job
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


class PlacementPass:
    """One pass over the queue: what it has given out so far (each tenant's devices, the nodes kept for multi-device
    jobs, the co-training groups it started) and how it tries each job: into a running group of its kind, else
    onto free devices."""

    def __init__(self, placer: Placer) -> None:
        self.placer, core = placer, placer.core
        self.core = core
        self.holding: dict[Tenant, int] = {t: n for t, n in core.devices_by_tenant.items() if n}
        self.table: ShareTable | None = None  # the tenants' shares as the pass began (fair sharing)
        self.limit: int | None = None  # the devices the tenant whose queue is being placed may reach in this turn
        self.placed = 0  # jobs placed in this pass
        self.kept_nodes = core.gang_holds = {
            n: j
            for n, j in core.gang_holds.items()
            if j in core.queue and n in core.fleet.nodes and not core.fleet.nodes[n].heartbeat.draining
        }
        self.kept = sharing.KeptNodes(core, self.kept_nodes)
        self.kept_for = {j: n for n, j in self.kept_nodes.items()}  # the same, by the job each node is kept for
        self.homeless: set[tuple] = set()  # shapes of gangs no node could be kept for in this pass
        self.no_room: set[tuple] = set()  # shapes of gangs (and the nodes kept from them) no node had room for
        self.needs: dict[str, int | None] = {}  # job -> what its device must have free when it joins a running group
        self.resting = placer.unanswered.resting()  # nodes that left assignments unanswered: none go there for now

    def kept_from(self, job: Job) -> frozenset[str]:
        """Nodes kept for a waiting multi-device job this one may not pass (sharing.KeptNodes: it has no higher
        priority, and its tenant is not owed the devices)."""
        tenant = job.stored.tenant
        share = self.table.share.get(tenant, 0) if self.table is not None else None
        kept = self.kept.from_job(job, self.holding.get(tenant, 0), share)
        return kept | self.resting if self.resting else kept

    def rounds(self) -> list[tuple[Tenant, JobQueue, bool]]:
        """The queues in the order they take their turns, each with whether it may only reach its fair share in that
        turn. fifo: the one queue. fair: admins' first (when above the tenants); then each tenant below its share,
        the furthest below first, up to its share; then every tenant in the same order, borrowing what is free."""
        core = self.core
        waiting = list(core.queue.waiting())
        if not core.queue.per_tenant:
            return [(None, queue, False) for _, queue in waiting]
        turns: list[tuple[Tenant, JobQueue, bool]] = [
            (None, q, False) for t, q in waiting if t is None and core.cfg.admins_above
        ]
        tenants = {t: q for t, q in waiting if not (t is None and core.cfg.admins_above)}
        if not tenants:
            return turns
        self.table = table = sharing.shares(core)
        order = sorted(tenants, key=lambda t: (table.ratio(t), -table.claims[t].weight, t or ""))
        turns += [(t, tenants[t], True) for t in order if table.held.get(t, 0) < table.share.get(t, 0)]
        return turns + [(t, tenants[t], False) for t in order]

    def quota_full(self, tenant: Tenant, devices: int) -> bool:
        """Whether `devices` more would take the tenant past its device quota (fifo), or past what it may hold
        (fair: nominal and borrow), or past its share in a turn that places only up to it."""
        holding = self.holding.get(tenant, 0) + devices
        cap = self.core.cfg.cap(tenant)
        return (cap is not None and holding > cap) or (self.limit is not None and holding > self.limit)

    def founds_group(self, job: Job) -> bool:
        """Whether the job starts a co-training group: others of its kind wait with it (counted as they queue), or it
        is a session (the next session of its kind joins it on its device: founds_alone)."""
        key = job.founder_key
        return (
            key is not None
            and not job.status.train_alone
            and (self.core.groupable[key] > 1 or founds_alone(job.stored.request))
        )

    def fits(self, node: str | None = None):
        return lambda job_id: self.try_place(job_id, node)

    def try_place(self, job_id: str, node: str | None) -> bool | None:
        """Whether the job was placed; None: not, at no cost (a gang of its shape found no room in this pass, and a
        pass frees nothing), which the queue's backfill window does not count."""
        core = self.core
        job = core.jobs[job_id]
        if job.lock.locked() or job_id in core.unsure or job.placing:  # being written, or read back
            return False
        req, tenant = job.stored.request, job.stored.tenant
        kept = self.kept_from(job)
        if node is not None and node in kept:
            return False
        joined = grouping.find_group(core.groups, core.cfg, req, tenant, kept, job.status.train_alone)
        if joined is not None:
            return self.join(job, *joined)
        if self.quota_full(tenant, req.devices):
            return False  # the tenant holds its quota of devices: the job waits, others pass it
        if req.devices == 1:
            slot = core.fleet.find(req.gpu_mib, req.accelerator, node, kept)
            slots = [slot] if slot else None
        else:
            shape = (req.gpu_mib, req.accelerator, req.devices, kept)
            if node is None and shape in self.no_room:
                self.placer._keep_for_gang(self, job_id, node, kept)
                return None
            slots = core.fleet.find_gang(req.gpu_mib, req.accelerator, req.devices, node, kept)
            if slots is None:
                if node is None:
                    self.no_room.add(shape)
                self.placer._keep_for_gang(self, job_id, node, kept)
        if not slots:
            return False
        # held while the assignment is written, so no other pass takes them; a job others of its kind wait with
        # starts a co-training group there, which they join
        core.hold_for(job, slots, grouping.new_group_id() if self.founds_group(job) else None)
        self.needs[job_id] = None
        if (home := self.kept_for.pop(job_id, None)) is not None:
            self.kept_nodes.pop(home, None)
            self.kept.changed()
        self.holding[tenant] = self.holding.get(tenant, 0) + len(slots)
        return True

    def join(self, job: Job, group: grouping.CoGroup, need: int) -> bool:
        """The job trains in the group's process from its next step (a device its tenant holds already adds
        nothing to its quota)."""
        tenant = job.stored.tenant
        adds = 0 if (tenant, group.slot) in self.core.tenant_slots else 1
        if self.quota_full(tenant, adds):
            return False
        self.core.hold_for(job, [group.slot], group.id, need)
        self.needs[job.id] = need
        self.holding[tenant] = self.holding.get(tenant, 0) + adds
        return True
