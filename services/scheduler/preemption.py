"""Preemption by checkpoint (fair sharing): a waiting job of a tenant below its fair share (or its nominal devices)
that no free device fits takes devices back from tenants over their share, the borrowers first; a tenant that lets
its jobs preempt its own (preempt:own) has its higher-priority jobs take its lower ones' devices.

A victim is paused (stop-and-save: it checkpoints at its current step and frees its device) through the same
fenced command a user's pause sends; once its node reports it paused, it is queued again at once, ahead of its
tenant's others of its priority, to go on from that checkpoint when its tenant's share allows (events.py). A Tinker
session's job stays paused instead, as after an idle pause: its next call resumes it.

No thrashing: a job runs --min-run-s before it may be preempted and is not preempted again within
--preempt-backoff-s; a waiting job whose tenant would go past its share by taking the device preempts nobody; the
victims must free what the waiting job can use (victims.py), and never more than it needs. A check runs every
CHECK_S for at most BUDGET_S, looking at a few waiting jobs per tenant and a bounded number of running ones each:
its cost never grows with the queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass

from schemas.job_status import ACTIVE_STATES
from services.aio import sleep_unless_stopped
from services.scheduler import grouping, sharing
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.pausing import PREEMPTED, Pausing
from services.scheduler.share_watch import ShareWatch
from services.scheduler.sharing import ShareTable
from services.scheduler.tenancy import Tenant
from services.scheduler.victims import Cursors, Plan, VictimSearch

log = logging.getLogger(__name__)
CHECK_S = 0.25  # how often waiting jobs are compared with the shares
AGAIN_S = 0.02  # the next check, when one ran out of its time
BUDGET_S = 0.005  # one check holds the loop at most about this long
MISSES = 32  # waiting jobs of one tenant in a row for which no victim was found: the check goes on to the next
PASSED = 16 * MISSES  # jobs asking more than their tenant is owed (never searched) passed over before they count
REFUSED_S = 5.0  # a victim whose pause failed (its node does not run it, say) is not chosen again within this


@dataclass
class InFlight:
    """A victim being paused: for whom, from whom, how many devices, which attempt."""

    waiting: str
    to: Tenant
    frm: Tenant
    devices: int
    attempt: int


class Preemption:
    """Chooses victims for waiting jobs and pauses them; counts what it did (stats)."""

    def __init__(self, core: SchedulerCore, pausing: Pausing) -> None:
        self.core, self.pausing = core, pausing
        self.budget_s = BUDGET_S  # a check's time (a projection's own check, in tests, is given all it needs)
        self.in_flight: dict[str, InFlight] = {}  # victim -> why it is being paused
        self.awaited: Counter[str] = Counter()  # waiting job -> its victims being paused
        self.freed_at: dict[str, float] = {}  # waiting job -> when its last victim's pause landed (monotonic)
        self.no_victims: dict[tuple, float] = {}  # a multi-device job's shape -> when the search found none for it
        self.stats: Counter[str] = Counter()
        self.watch = ShareWatch(core)  # whether the shares hold: how long a tenant below its share waits
        self._kept = sharing.KeptNodes(core, {})  # the nodes kept for gangs, for the check under way
        self._homes: dict[str, str] = {}  # the same, by the job each is kept for
        self.refused: dict[str, float] = {}  # victims whose pause failed -> when (monotonic)
        self.claims: dict[str, tuple[str, int]] = {}  # a served gang -> its node, the free devices its plan counted
        self._claimed: Counter[str] = Counter()  # the same by node, for the check under way

    async def run(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        core, more = self.core, False
        self.watch.restart()  # this term's waits only
        while not (stop.is_set() or lost.is_set()):
            if await sleep_unless_stopped(stop, AGAIN_S if more else CHECK_S):
                return
            more = core.cfg.sharing == "fair" and len(core.queue) > 0 and core.may_act() and self.check()
            if not core.queue and self.watch.waiting:  # nothing waits: no tenant waits below its share
                self.watch.settled()

    def check(self) -> bool:
        """One look at the waiting tenants: victims chosen and their pauses sent (in tasks of their own); True when
        it ran out of its time with more to look at."""
        core, started = self.core, time.perf_counter()
        self.stats["checks"] += 1
        self._prune()
        table = sharing.shares(core)
        self.watch.observe(table)
        held = dict(table.held)  # as it will be once the pauses under way land
        for f in self.in_flight.values():
            held[f.frm] = held.get(f.frm, 0) - f.devices
            held[f.to] = held.get(f.to, 0) + f.devices
        now = time.monotonic()
        cursors = Cursors(core, time.time() - core.cfg.min_run_s, lambda j: self._eligible(core.jobs.get(j), now))
        self._kept = sharing.KeptNodes(core, core.gang_holds)  # as they stand for this check
        self._homes = {j: n for n, j in core.gang_holds.items()}
        self._claimed = Counter()
        for node, n in self.claims.values():
            self._claimed[node] += n
        waiting = {t for t, _ in core.queue.waiting()}
        for tenant in sorted(waiting, key=lambda t: held.get(t, 0) / max(table.share.get(t, 0), 1e-9)):
            if not (self._own(tenant) or self._over(tenant, table, held)):
                continue  # nobody it could take a device from
            if self._look(tenant, table, held, cursors, started):
                return True
        return False

    def _look(self, tenant: Tenant, table: ShareTable, held: dict[Tenant, int], cursors: Cursors, started) -> bool:
        """Victims for the tenant's waiting jobs, best first: those any node may take, then those pinned to a known
        node. A job it could not be given (one that wants more than the tenant is owed, one no victim frees room
        for) is passed over: the jobs behind it are looked at too, up to MISSES of each kind in a row. True when
        the check ran out of its time."""
        core = self.core
        queue = core.queue.of(tenant)
        if queue is None:
            return False
        for nodes in ([None], queue.pinned_nodes(among=core.fleet.nodes)):
            misses, passed = 0, 0
            for node in nodes:
                with contextlib.closing(queue.peek(node)) as heads:
                    for job_id in heads:
                        if time.perf_counter() - started > self.budget_s:
                            return True
                        if misses >= MISSES or not (self._own(tenant) or self._owed(tenant, 1, table, held)):
                            break  # enough misses; or the tenant is owed nothing more (and swaps nothing)
                        job = core.jobs[job_id]
                        if self._served(job_id) or self._none_lately(job):
                            continue  # its victims are on their way, or its shape's search found none lately
                        wanted = self._wants(job, table, held)
                        plan = self._plan(job, table, held, cursors) if wanted else None
                        if plan is None and not wanted and passed < PASSED:
                            passed += 1  # not searched: 32 8-device jobs at the head hid the 1-device ones for good
                        elif plan is None:
                            misses += 1
                        else:
                            misses = 0  # in a row: a job served counts the next ones afresh
                            self._preempt(plan, table, held)
                if misses >= MISSES:
                    break
        return False

    def _prune(self) -> None:
        """Pauses that landed (or whose victim ended, or moved on) no longer count as under way; refusals older
        than REFUSED_S are forgotten."""
        now = time.monotonic()
        if self.refused:
            self.refused = {j: at for j, at in self.refused.items() if now - at < REFUSED_S}
        interval = self.core.cfg.heartbeat_interval
        if self.freed_at:
            self.freed_at = {j: at for j, at in self.freed_at.items() if now - at < interval}
        if self.no_victims:
            self.no_victims = {k: at for k, at in self.no_victims.items() if now - at < interval}
        for victim, f in list(self.in_flight.items()):
            job = self.core.jobs.get(victim)
            if job is None or job.status.state not in ACTIVE_STATES or job.status.attempt != f.attempt:
                self._landed(victim, now)
        jobs = self.core.jobs  # a gang placed holds what it claimed: the claim goes
        self.claims = {
            w: c for w, c in self.claims.items() if self._served(w) and w in jobs and not jobs[w].status.node
        }

    def _landed(self, victim: str, now: float | None = None) -> None:
        """The victim's pause landed (at `now`), or failed (None: it frees nothing, its job may have others)."""
        f = self.in_flight.pop(victim, None)
        if f is not None:
            self.awaited[f.waiting] -= 1
            if self.awaited[f.waiting] <= 0:
                del self.awaited[f.waiting]
                if now is not None:
                    self.freed_at[f.waiting] = now

    def _served(self, job_id: str) -> bool:
        """Whether victims were chosen for the waiting job and what they free is not yet seen free: their pauses
        are under way, or the last landed less than a heartbeat ago (a device shows free in its node's next
        heartbeat). Choosing more for it then took one more of another tenant's jobs at every check."""
        if self.awaited[job_id]:
            return True
        at = self.freed_at.get(job_id)
        return at is not None and time.monotonic() - at < self.core.cfg.heartbeat_interval

    def _shape(self, job: Job) -> tuple:
        """What a gang's search depends on: its tenant, memory, devices, priority, node, and its own kept node."""
        req = job.stored.request
        home = self._homes.get(job.id)
        return (job.stored.tenant, req.gpu_mib, req.accelerator, req.devices, req.priority, req.node, home)

    def _none_lately(self, job: Job) -> bool:
        """Whether a multi-device job of its shape (tenant, memory, devices, priority, node) found no victims within
        a heartbeat interval (what may be taken changes as heartbeats come and jobs pass --min-run-s). Such a search
        reads up to victims.SCAN running jobs (4-5 ms at 1,000 nodes); every check began again at the tenant's head,
        so two such jobs there took each check's whole time, and nothing was preempted for the jobs behind them."""
        if job.stored.request.devices <= 1 or not self.no_victims:
            return False
        at = self.no_victims.get(self._shape(job))
        return at is not None and time.monotonic() - at < self.core.cfg.heartbeat_interval

    def _wants(self, job: Job, table: ShareTable, held: dict[Tenant, int]) -> bool:
        """Whether the tenant's job may take a device by preemption at all: owed what it asks for (below its share,
        within what it may hold), or allowed to preempt its tenant's own lower ones (a swap)."""
        tenant = job.stored.tenant
        return self._owed(tenant, job.stored.request.devices, table, held) or self._own(tenant)

    def _own(self, tenant: Tenant) -> bool:
        return tenant is not None and self.core.cfg.quota(tenant).preempt_own

    def _owed(self, tenant: Tenant, need: int, table: ShareTable, held: dict[Tenant, int]) -> bool:
        """Whether `need` more devices keep the tenant within its fair share (admins above the tenants: what they
        want) and what it may hold."""
        cap = self.core.cfg.cap(tenant)
        if cap is not None and held.get(tenant, 0) + need > cap:
            return False
        return held.get(tenant, 0) + need <= table.share.get(tenant, 0)

    def _plan(self, job: Job, table: ShareTable, held: dict[Tenant, int], cursors: Cursors) -> Plan | None:
        core, req, tenant = self.core, job.stored.request, job.stored.tenant
        kept = self._kept.from_job(job, held.get(tenant, 0), table.share.get(tenant, 0))
        if job.lock.locked() or job.placing or job.id in core.unsure or self._fits_now(job, kept):
            return None  # being written, or the next placement pass places it
        now = time.monotonic()
        search = VictimSearch(core, job, lambda v: self._eligible(v, now), kept, self._claimed)
        if self._owed(tenant, req.devices, table, held):  # devices in flight to it count: never more than owed

            def over_share(t: Tenant, n: int) -> bool:  # t is over its share, and giving up n leaves it at it at least
                share = table.share.get(t, 0)
                return t != tenant and held.get(t, 0) > share and held.get(t, 0) - n >= share

            for victim in self._over(tenant, table, held):
                candidates = cursors.on_node(victim, req.node) if req.node is not None else cursors.of(victim)
                plan = search.first(candidates, over_share)
                if plan is not None:
                    return plan
        plan = None
        if self._own(tenant):  # a swap (a job with victims under way is not looked at: _served)
            plan = search.first(cursors.own(tenant, req.priority, req.node), lambda t, n: t == tenant)
        if plan is None:
            self.stats["unfound"] += 1  # searches that found no victims
            if req.devices > 1:
                self.no_victims[self._shape(job)] = now
        return plan

    def _over(self, tenant: Tenant, table: ShareTable, held: dict[Tenant, int]) -> list[Tenant]:
        """Tenants over their share, the borrowers first, then the furthest over (by weight)."""
        cfg = self.core.cfg
        over = [
            t
            for t in table.share
            if t != tenant and held.get(t, 0) > table.share[t] and not (t is None and cfg.admins_above)
        ]

        def order(t: Tenant):
            nominal = table.claims[t].nominal if t in table.claims else 0
            return (held.get(t, 0) <= nominal, -(held.get(t, 0) - table.share[t]) / cfg.quota(t).weight, t or "")

        return sorted(over, key=order)

    def _fits_now(self, job: Job, kept: frozenset[str]) -> bool:
        """Whether the next placement pass could place the job as things stand (nodes kept from it left out)."""
        core, req = self.core, job.stored.request
        if req.node is not None and req.node in kept:
            return False
        if req.devices > 1:
            return core.fleet.find_gang(req.gpu_mib, req.accelerator, req.devices, req.node, kept) is not None
        if core.fleet.find(req.gpu_mib, req.accelerator, req.node, kept) is not None:
            return True
        return (
            grouping.find_group(core.groups, core.cfg, req, job.stored.tenant, kept, job.status.train_alone) is not None
        )

    def _eligible(self, v: Job | None, now: float) -> bool:
        """A running job that has run its minimum, was not preempted lately, is not being paused, and that its node's
        last heartbeat lists running (one that ended there, its end not read yet, frees nothing: its node refuses
        the pause, and is not asked again for REFUSED_S)."""
        if v is None:
            return False
        core, cfg = self.core, self.core.cfg
        entry = core.book.running.jobs.get(v.id)
        view = core.fleet.nodes.get(v.status.node or "")
        return (
            entry is not None
            and v.status.state == "running"
            and now - entry.started >= cfg.min_run_s
            and time.time() - v.status.preempted_at >= cfg.preempt_backoff_s
            and v.id not in self.in_flight
            and v.id not in core.pausing
            and not v.lock.locked()
            and view is not None
            and v.id in view.running
            and now - self.refused.get(v.id, -REFUSED_S) >= REFUSED_S
        )

    def _preempt(self, plan: Plan, table: ShareTable, held: dict[Tenant, int]) -> None:
        waiting = plan.waiting
        tenant, need = waiting.stored.tenant, waiting.stored.request.devices
        why = self._why(waiting, table, held)
        charged: set[Tenant] = set()
        if plan.claims is not None:  # its node's free devices are its own until its victims' devices show free
            self.claims[waiting.id] = plan.claims
            self._claimed[plan.claims[0]] += plan.claims[1]
        for victim in plan.victims:
            frm = victim.stored.tenant
            devices = 0 if frm in charged else plan.frees.get(frm, 0)  # each victim tenant's devices counted once
            charged.add(frm)
            self.in_flight[victim.id] = InFlight(waiting.id, tenant, frm, devices, victim.status.attempt)
            self.awaited[waiting.id] += 1
            self.core.spawn(self._pause(victim, why))
        for t, n in plan.frees.items():
            held[t] = held.get(t, 0) - n
        held[tenant] = held.get(tenant, 0) + need
        self.watch.planned[tenant] += need
        self.stats["preemptions"] += 1
        self.stats["victims"] += len(plan.victims)
        log.info(
            "preempting %s for job %s of %s: %s",
            ", ".join(v.id for v in plan.victims),
            waiting.id,
            f"tenant {tenant}" if tenant else "an admin",
            why,
        )

    def _why(self, waiting: Job, table: ShareTable, held: dict[Tenant, int]) -> str:
        """What the victims' events and `jetlora why` say."""
        tenant = waiting.stored.tenant
        now = table.held.get(tenant, 0)
        if tenant is None and self.core.cfg.admins_above:
            return f"{PREEMPTED}an admin's job {waiting.id} needs the device (admins' jobs come before tenants')"
        if self._owed(tenant, waiting.stored.request.devices, table, held):
            nominal = self.core.cfg.quota(tenant).nominal if tenant is not None else 0
            who = f"tenant {tenant}" if tenant is not None else "admins"
            if now < nominal:
                return f"{PREEMPTED}{who} below its nominal quota ({now} of {nominal} devices)"
            return f"{PREEMPTED}{who} below its fair share ({now} of {table.share.get(tenant, 0)} devices)"
        return (
            f"{PREEMPTED}job {waiting.id} of tenant {tenant} has priority {waiting.stored.request.priority} "
            f"(the tenant's jobs preempt its own lower ones: preempt:own)"
        )

    async def _pause(self, victim: Job, why: str) -> None:
        try:
            error = await self.pausing.pause(victim, why)
            failure = error.error if error is not None else ""
        except Exception as e:  # the store or the bus away: the next check looks again
            failure = f"{type(e).__name__}: {e}"
        if failure:
            self._landed(victim.id)
            self.refused[victim.id] = time.monotonic()
            self.stats["failed"] += 1
            log.info("could not preempt job %s (%s); the next check looks again", victim.id, failure)
