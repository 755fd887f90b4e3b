"""What the scheduler holds in memory, and the one way a job's status changes: under its lock, through the store."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client

from schemas.jobs import JobId, JobRequest, NodeId
from schemas.job_status import TERMINAL_STATES, JobState, JobStatus, StoredRequest
from services.scheduler.fleet import Fleet, SlotKey
from services.scheduler.queue import TenantQueues
from services.scheduler.request_cache import RequestCache
from services.scheduler.index import Finished, JobIndex
from services.scheduler.config import SchedulerConfig, TenantQuota
from services.scheduler.engine_pauses import engine_slot
from services.scheduler.fence import Deposed
from services.scheduler.grouping import FounderKey, Groups, founder_key, holder
from services.scheduler.store import JobStore
from services.scheduler.tenancy import TenantBook, held
from services.scheduler.unanswered import Unanswered

__all__ = ["SchedulerConfig", "SchedulerCore", "TenantQuota", "Job", "UNPLACED", "held"]
log = logging.getLogger(__name__)
UNPLACED: dict[str, Any] = dict(
    node=None, device=None, devices=[], group=None
)  # a job's status fields when it holds no device
STATES_REDELIVERED_S = 5.0  # a state event taken but not applied by the last leader comes again within this
AHEAD = 1 << 50  # a preempted job waits ahead of its tenant's others of its priority (its seq less this)


@dataclass
class Job:
    """A job as the scheduler holds it: its request without the data, and its status as last stored."""

    stored: StoredRequest
    status: JobStatus
    revision: int = 0
    assigned_at: float = 0.0  # monotonic: when it last took a node (the grace for the node to list it runs from it)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one status write at a time, each from the latest
    suspect: bool = False  # a check that its node lost it is under way
    placing: list[SlotKey] | None = None  # devices held for it while its assignment is being written
    placing_group: str | None = None  # the co-training group it is being placed into
    lost_from: tuple[NodeId, int, int] | None = None  # (node, attempt, retries used before) when a node went silent
    founder_key: FounderKey | None = None  # what it could start a co-training group with (None: it trains alone)

    @property
    def id(self) -> JobId:
        return self.stored.id

    @property
    def slots(self) -> list[SlotKey]:
        """The devices the job holds: none, one, or all of a multi-device job's."""
        return held(self.status)


class SchedulerCore:
    """The scheduler's state: its jobs, queue and fleet, and the writes that change a job.

    Memory is a projection of what the store holds: a job's status changes in memory only once its write was
    stored (apply), and the queue, the devices held, each node's jobs and the tenants' counts follow from the
    statuses alone. The scheduler's parts (placer, pausing, events, liveness, reconcile, retention, api) each hold
    this one core and change a job only through set_state / requeue, under the job's lock."""

    store: JobStore
    index: JobIndex

    def __init__(self, nc: Client, config: SchedulerConfig | None = None) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.cfg = config or SchedulerConfig()
        self.tasks: set[asyncio.Task] = set()
        self.lost = asyncio.Event()  # set when this scheduler must stop leading (its term was taken)
        self.lease_valid: Callable[[], bool] = lambda: True  # the lease's own clock (set while leading)
        self.term = 0  # the term this scheduler leads in: every command it sends a node carries it
        self.reset()

    def reset(self) -> None:
        """Forget everything held: a scheduler that stops leading starts from the store when it leads again."""
        self.jobs: dict[JobId, Job] = {}
        self.queue = TenantQueues(per_tenant=self.cfg.sharing == "fair")
        self.fleet = Fleet()
        self.by_node: dict[NodeId, set[JobId]] = {}
        self.awaited: dict[NodeId, float] = {}  # nodes with jobs at recovery, not heard since: deadline
        self.gang_holds: dict[NodeId, JobId] = {}  # nodes kept for a waiting multi-device job
        self.engine_paused: dict[SlotKey, set[JobId]] = {}  # jobs paused for a device's serving engine
        self.pausing: set[JobId] = set()  # pauses asked of nodes, not yet answered
        self.unsure: set[JobId] = set()  # jobs whose last write went unanswered: read back before anything else
        self.submitting: set[JobId] = set()  # submissions being stored: marked active, not yet in memory
        self.pins_in_flight: Counter[str] = Counter()  # datasets pinned by submissions being stored (by object)
        self.seq = 0
        self.requests = RequestCache()  # queued jobs' full requests, so placing one reads nothing
        self.wake = asyncio.Event()
        self.unanswered = Unanswered(self.cfg.assign_timeout, wake=self.wake.set)  # nodes resting: no answer came
        self.recheck = asyncio.Event()  # the reconcile loop has jobs to read back
        self.finished: dict[JobId, float] = {}  # finished jobs still in memory -> when they ended (monotonic), in order
        self.book = TenantBook()  # each tenant's waiting jobs, devices held and running jobs, counted as they change
        self.queued_by_tenant, self.devices_by_tenant = self.book.queued, self.book.devices
        self.tenant_slots: Counter[tuple[str | None, Any]] = self.book.slots  # (tenant, slot) -> its jobs there
        self.groupable: Counter[FounderKey] = self.book.groupable  # queued jobs that could start a group, by kind
        self.groups = Groups(self.fleet, self.cfg)  # co-training groups, a projection of the statuses and placements
        self.connected_at = time.monotonic()  # the last proof that the store answers us (a lease renewal)
        self.heard_at = float("-inf")  # when any heartbeat last came in

    # --- leading -------------------------------------------------------------------------------
    def may_act(self) -> bool:
        """Whether this scheduler may act on what it holds now: asked at the moment it writes or sends, never once
        per pass, since a loop that was late may have outlived its lease. A lease lapsed here stops the leading."""
        if self.lost.is_set():
            return False
        if not self.lease_valid():
            log.error("the scheduler lease lapsed before this scheduler acted (its loop was late); stepping down")
            self.lost.set()
            return False
        return True

    # --- tasks ---------------------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception():
            log.error("scheduler task failed: %r", task.exception(), exc_info=task.exception())

    # --- memory as a projection of stored statuses ------------------------------------------------
    def adopt(self, stored: StoredRequest, status: JobStatus | None, revision: int) -> Job:
        """Take a stored job into memory as the store has it; a node holding one is awaited for a window."""
        job = Job(stored, status or JobStatus(updated=stored.created), revision)
        job.founder_key = founder_key(self.cfg, stored.request, stored.tenant)
        self.jobs[job.id] = job
        self.seq = max(self.seq, stored.seq)
        self._project(job, None, job.status)
        if job.status.node is not None and job.slots:
            self.awaited.setdefault(job.status.node, time.monotonic() + self.cfg.window)
            job.assigned_at += STATES_REDELIVERED_S  # its node's last word may still be on its way to us
        return job

    def take_new(self, job: Job, request: JobRequest, size: int) -> None:
        """A job just stored joins memory and the queue (its full request cached, so placing it reads nothing)."""
        job.founder_key = founder_key(self.cfg, job.stored.request, job.stored.tenant)
        self.jobs[job.id] = job
        self.requests.put(job.id, request, size)
        self._project(job, None, job.status)

    def apply(self, job: Job, status: JobStatus, revision: int) -> None:
        """The job's status was stored: memory follows it."""
        old, job.status, job.revision = job.status, status, revision
        self._project(job, old, status)

    def _project(self, job: Job, old: JobStatus | None, new: JobStatus) -> None:
        """Move what memory derives from a job's status from `old` (None: not counted yet) to `new`."""
        before, after = (held(old) if old else []), held(new)
        old_holder, new_holder = holder(job.id, old.group if old else None), holder(job.id, new.group)
        if old is not None:
            self._count(job, old, -1)
            self._leave(
                job, old.group if before else None, [s for s in before if s not in after or old_holder != new_holder]
            )
            if before and (not after or old.node != new.node):
                self.by_node.get(old.node or "", set()).discard(job.id)
            if old.state == "paused":
                self._unnote_paused(job.id, old)
        self._count(job, new, 1)
        self.book.running.update(job.id, job.stored.tenant, job.stored.request.priority, old, new)
        for slot in after:
            taken = self.fleet.reserved.get(slot)
            if taken not in (None, new_holder):
                log.error("job %s holds %s device %d, which %s holds too", job.id, *slot, taken)
            self.fleet.reserve(slot, new_holder)
            if new.group:
                self.groups.join(new.group, slot, job.id, job.stored.request, job.stored.tenant)
        if after and new.node is not None:
            self.by_node.setdefault(new.node, set()).add(job.id)
            if old is None or (old.node, old.attempt) != (new.node, new.attempt) or not before:
                job.assigned_at = time.monotonic()
        if new.state == "queued" and job.placing is None:
            if job.id not in self.queue:
                self.enqueue(job)
        else:
            self.queue.discard(job.id)
        if new.state == "paused":
            self.note_paused(job)
        if new.state in TERMINAL_STATES and (old is None or old.state not in TERMINAL_STATES):
            self.finished.pop(job.id, None)
            self.finished[job.id] = time.monotonic()  # at the end: the dict stays in the order jobs ended
            self.requests.take(job.id)
        if before != after:
            self.wake.set()

    def _leave(self, job: Job, group: str | None, slots: list[SlotKey]) -> None:
        """The job no longer holds `slots`: each goes back unless the job's group still trains there."""
        if not slots:
            return
        if group is not None and not self.groups.leave(group, job.id):
            return  # the group's other jobs keep the device
        for slot in slots:
            self.fleet.release(slot, holder(job.id, group))

    def hold_for(self, job: Job, slots: list[SlotKey], group: str | None = None, need: int | None = None) -> None:
        """Hold devices for a job while a write that gives them to it is under way (a placement, a node's attempt
        taken back): no other job is placed there, and the job leaves the queue until the write is answered. A job
        placed into a co-training group holds the group's device with the group (`need`: the MiB it adds there,
        when known)."""
        for slot in slots:
            self.fleet.reserve(slot, holder(job.id, group))
            if group is not None:
                self.groups.join(group, slot, job.id, job.stored.request, job.stored.tenant, need)
        job.placing, job.placing_group = slots, group
        self.queue.discard(job.id)

    def unhold(self, job: Job) -> None:
        """The write answered (or failed): what the job's status holds stays held, the rest is free again, and a
        job still queued goes back to its place."""
        slots, group = job.placing or [], job.placing_group
        job.placing, job.placing_group = None, None
        kept = held(job.status) if job.status.group == group else []
        self._leave(job, group, [slot for slot in slots if slot not in kept])
        if job.status.state == "queued" and job.id not in self.queue:
            self.enqueue(job)

    async def lookup(self, job_id: JobId) -> Job | None:
        """The job from memory, else from the store: an active one found there is taken up (it should have been
        in memory), a finished one is answered without being kept. None: no such job. Raises if the store is away."""
        job = self.jobs.get(job_id)
        if job is not None:
            return job
        found = await self.store.find(job_id)
        if found is None:
            return self.jobs.get(job_id)
        stored, status, revision = found
        if status is not None and status.state in TERMINAL_STATES:
            return self.jobs.get(job_id) or Job(stored, status, revision)
        if job_id in self.submitting or job_id in self.jobs:  # stored while we read: it is joining memory now
            return self.jobs.get(job_id) or Job(stored, status or JobStatus(updated=stored.created), revision)
        log.warning("job %s was not in memory but is active in the jobs bucket; taking it up", job_id)
        return self.adopt(stored, status, revision)

    def _count(self, job: Job, status: JobStatus, sign: int) -> None:
        """Count a job in (1) or out of (-1) its tenant's figures as `status` stands (tenancy.TenantBook)."""
        req = job.stored.request
        self.book.count(job.id, job.stored.tenant, req.devices, job.founder_key, status, sign)

    def forget(self, job_id: JobId) -> None:
        """A finished job leaves memory; the store still answers for it."""
        self.finished.pop(job_id, None)
        job = self.jobs.pop(job_id, None)
        if job is not None:
            self._count(job, job.status, -1)
            self.book.running.update(job_id, job.stored.tenant, job.stored.request.priority, job.status, JobStatus())

    def enqueue(self, job: Job) -> None:
        req, seq = job.stored.request, job.stored.seq
        self.queue.push(job.id, req.priority, seq - AHEAD if job.status.preempted else seq, req.node, job.stored.tenant)
        self.wake.set()

    def note_paused(self, job: Job) -> None:
        """A job paused for a device's serving engine waits for that engine (engine_pauses.engine_slot)."""
        if (slot := engine_slot(job.status.paused_by)) is not None:
            self.engine_paused.setdefault(slot, set()).add(job.id)

    def _unnote_paused(self, job_id: JobId, status: JobStatus) -> None:
        if (slot := engine_slot(status.paused_by)) is not None:
            self.engine_paused.get(slot, set()).discard(job_id)

    # --- status writes ---------------------------------------------------------------------------
    async def _write(self, job: Job, status: JobStatus) -> int:
        """Store a job's new status; its revision. Raises, memory untouched: Deposed (another scheduler leads:
        this one stops), or anything else (the job is read back before its next change)."""
        try:
            return await self.store.write_status(job.id, status, job.revision)
        except Deposed:
            self.lost.set()
            raise
        except Exception:
            self.unsure.add(job.id)
            self.recheck.set()
            raise

    async def reload_locked(self, job: Job) -> None:
        """Read the job's status back from the store after a write whose outcome is unknown (under its lock)."""
        found = await self.store.status(job.id)
        if found is not None and found[1] != job.revision:
            log.warning("job %s: a write whose answer was lost did land (%s); memory follows", job.id, found[0].state)
            self.apply(job, *found)
        self.unsure.discard(job.id)
        self.wake.set()  # a placement pass that skipped it while it was unsure may place it now

    async def record_end(self, job: Job) -> None:
        """A job that ended leaves the active set and enters the index in finishing order. Should either write
        fail, its record is already final: a scheduler taking over finds it active but ended, and does both."""
        try:
            await self.index.finished(
                Finished(
                    job=job.id,
                    tenant=job.stored.tenant,
                    state=job.status.state,
                    finished=job.status.updated or time.time(),
                    submitted_seq=job.stored.index_seq,
                )
            )
            await self.store.unmark_active(job.id)
        except Exception as e:
            log.warning(
                "job %s ended, but its index entries could not be written (%s: %s); the next scheduler "
                "to lead writes them",
                job.id,
                type(e).__name__,
                e,
            )

    async def set_state(
        self, job: Job, state: JobState, message: str, when: Callable[[JobStatus], bool] | None = None, **changes
    ) -> bool:
        """Change a job's state if `when(status)` holds (checked under the job's lock, on the stored status);
        False if not written because it did not hold. Raises when the write failed (memory unchanged)."""
        async with job.lock:
            if job.id in self.unsure:
                await self.reload_locked(job)
            if when is not None and not when(job.status):
                return False
            return await self.set_state_locked(job, state, message, **changes)

    async def set_state_locked(self, job: Job, state: JobState, message: str, **changes) -> bool:
        if job.id in self.unsure:
            await self.reload_locked(job)
        if job.status.state in TERMINAL_STATES and state != job.status.state:
            log.warning("job %s ended %s; not replaced by %s (%s)", job.id, job.status.state, state, message)
            return False
        status = msgspec.structs.replace(job.status, state=state, message=message, updated=time.time(), **changes)
        ended = state in TERMINAL_STATES and job.status.state not in TERMINAL_STATES
        self.apply(job, status, await self._write(job, status))
        if ended:
            await self.record_end(job)
        return True

    async def requeue(self, job: Job, why: str, when: Callable[[JobStatus], bool] | None = None, **changes) -> bool:
        return await self.set_state(job, "queued", why, when=when, **UNPLACED, **changes)
