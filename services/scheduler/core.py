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

from schemas.jobs import ACTIVE_STATES, TERMINAL_STATES, JobId, JobRequest, JobState, JobStatus, NodeId, StoredRequest
from services.scheduler.placement import Fleet, SlotKey
from services.scheduler.queue import JobQueue
from services.registry.store import AdapterRegistry
from services.scheduler.index import Finished, JobIndex
from services.scheduler.store import Conflict, JobStore

log = logging.getLogger(__name__)
REQUEST_CACHE_BYTES = 64 * 2**20  # full requests of queued jobs kept in memory, so placing one needs no KV read
REQUEST_CACHE_ITEM = 64 * 2**10
UNPLACED: dict[str, Any] = dict(node=None, device=None, devices=[])  # a job's status fields when it holds no device


def engine_tag(slot: SlotKey) -> str:
    """How a pause for a device's serving engine is recorded (JobStatus.paused_by)."""
    return f"engine {slot[0]}/{slot[1]}"


def engine_slot(paused_by: str | None) -> SlotKey | None:
    if not paused_by or not paused_by.startswith("engine "):
        return None
    node, _, device = paused_by.removeprefix("engine ").rpartition("/")
    return (node, int(device)) if device.lstrip("-").isdigit() else None


@dataclass
class Job:
    """A job as the scheduler holds it: its request without the data, and its status."""

    stored: StoredRequest
    status: JobStatus
    revision: int = 0
    assigned_at: float = 0.0  # monotonic
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one status write at a time, each from the latest
    suspect: bool = False  # a check that its node lost it is under way

    @property
    def id(self) -> JobId:
        return self.stored.id

    @property
    def slots(self) -> list[SlotKey]:
        """The devices the job holds: none, one, or all of a multi-device job's."""
        s = self.status
        if s.node is None or s.device is None:
            return []
        return [(s.node, d) for d in s.devices or [s.device]]


@dataclass(frozen=True)
class TenantQuota:
    """What one tenant may hold at once; None: no limit."""

    queued: int | None = None  # jobs waiting for a device
    devices: int | None = None  # devices its running jobs hold

    @classmethod
    def parse(cls, text: str) -> "TenantQuota":
        """`queued:10,devices:2` (either may be left out)."""
        limits = {}
        for part in filter(None, text.split(",")):
            key, _, value = part.partition(":")
            if key not in ("queued", "devices") or not value.isdigit():
                raise ValueError(f"quota {text!r}: write queued:N,devices:M")
            limits[key] = int(value)
        return cls(**limits)


@dataclass
class SchedulerConfig:
    heartbeat_interval: float = 1.0
    misses: int = 3
    assign_timeout: float = 2.0
    backfill_window: int = 64
    max_concurrent_submits: int = 256
    idempotency_window_s: float = 24 * 3600.0  # a key sent again within this returns its first job
    finished_in_memory_s: float = 600.0  # a finished job stays in memory this long, then is read from the store
    retention_s: float = 30 * 24 * 3600.0  # a finished job's record and events are removed this long after; 0: never
    retention_artifacts: bool = False  # and its artifacts with them
    sweep_interval_s: float = 60.0  # how often expired records are looked for
    reclaim_pause_priority: int = 0  # jobs at or below this priority pause when their device's engine wants memory
    quotas: dict[str, TenantQuota] = field(default_factory=dict)  # per tenant
    default_quota: TenantQuota = TenantQuota()  # for tenants not in quotas

    def quota(self, tenant: str | None) -> TenantQuota:
        return TenantQuota() if tenant is None else self.quotas.get(tenant, self.default_quota)

    @property
    def window(self) -> float:
        return self.heartbeat_interval * self.misses


class SchedulerCore:
    """The scheduler's state: its jobs, queue and fleet, and the writes that change a job.

    The scheduler's parts (placer, pausing, events, liveness, retention, api) each hold this one core and
    change a job only through set_state / requeue, under the job's lock."""

    store: JobStore
    index: JobIndex
    adapters: AdapterRegistry

    def __init__(self, nc: Client, config: SchedulerConfig | None = None) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.cfg = config or SchedulerConfig()
        self.tasks: set[asyncio.Task] = set()
        self.reset()

    def reset(self) -> None:
        """Forget everything held: a scheduler that stops leading starts from the store when it leads again."""
        self.jobs: dict[JobId, Job] = {}
        self.queue = JobQueue()
        self.fleet = Fleet()
        self.by_node: dict[NodeId, set[JobId]] = {}
        self.awaited: dict[NodeId, float] = {}  # nodes with jobs at recovery, not heard since: deadline
        self.gang_holds: dict[NodeId, JobId] = {}  # nodes kept for a waiting multi-device job
        self.engine_paused: dict[SlotKey, set[JobId]] = {}  # jobs paused for a device's serving engine
        self.pausing: set[JobId] = set()  # pauses asked of nodes, not yet answered
        self.seq = 0
        self.full_requests: dict[JobId, tuple[JobRequest, int]] = {}  # job -> (request with data, its size)
        self.cached_bytes = 0
        self.wake = asyncio.Event()
        self.finished: dict[JobId, float] = {}  # finished jobs still in memory -> when they ended (monotonic), in order
        self.queued_by_tenant: Counter[str | None] = Counter()  # counted as states change, never by a scan
        self.devices_by_tenant: Counter[str | None] = Counter()

    # --- tasks ---------------------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception():
            log.error("scheduler task failed: %r", task.exception(), exc_info=task.exception())

    # --- jobs in memory --------------------------------------------------------------------------
    def adopt(self, stored: StoredRequest, status: JobStatus | None, revision: int) -> Job:
        """Take a stored job into memory: queue it, or hold its slot until its node is heard from."""
        now = time.monotonic()
        job = Job(stored, status or JobStatus(updated=stored.created), revision, assigned_at=now)
        self.jobs[job.id] = job
        self._count(job, 1)
        if job.status.state in TERMINAL_STATES:
            self.finished.pop(job.id, None)
            self.finished[job.id] = now  # at the end: the dict stays in the order jobs ended
        self.seq = max(self.seq, stored.seq)
        if job.status.state == "queued":
            self.enqueue(job)
        elif job.status.state in ACTIVE_STATES and job.slots and (node := job.status.node) is not None:
            for slot in job.slots:
                self.fleet.reserve(slot, job.id)
            self.by_node.setdefault(node, set()).add(job.id)
            self.awaited.setdefault(node, now + self.cfg.window)
        elif job.status.state == "paused":
            self.note_paused(job)
        return job

    def take_new(self, job: Job, request: JobRequest, size: int) -> None:
        """A job just stored joins memory and the queue (its full request cached, so placing it reads nothing)."""
        self.jobs[job.id] = job
        self._count(job, 1)
        self._cache_request(job.id, request, size)
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
        log.warning("job %s was not in memory but is active in the jobs bucket; taking it up", job_id)
        return self.jobs.get(job_id) or self.adopt(stored, status, revision)

    def _count(self, job: Job, sign: int) -> None:
        """Count a job in (1) or out of (-1) its tenant's queued jobs and held devices, as its status stands."""
        if job.status.state == "queued":
            self.queued_by_tenant[job.stored.tenant] += sign
        elif job.status.state in ACTIVE_STATES:
            self.devices_by_tenant[job.stored.tenant] += sign * max(1, len(job.status.devices))

    def forget(self, job_id: JobId) -> None:
        """A finished job leaves memory; the store still answers for it."""
        self.finished.pop(job_id, None)
        job = self.jobs.pop(job_id, None)
        if job is not None:
            self._count(job, -1)

    def enqueue(self, job: Job) -> None:
        req = job.stored.request
        self.queue.push(job.id, req.priority, job.stored.seq, req.node)
        self.wake.set()

    def note_paused(self, job: Job) -> None:
        """A job paused for a device's serving engine waits for that engine (see pausing.engine_slot)."""
        if (slot := engine_slot(job.status.paused_by)) is not None:
            self.engine_paused.setdefault(slot, set()).add(job.id)

    def note_unpaused(self, job: Job) -> None:
        if (slot := engine_slot(job.status.paused_by)) is not None:
            self.engine_paused.get(slot, set()).discard(job.id)

    def _leave_slot(self, job: Job) -> None:
        if job.slots:
            for slot in job.slots:
                self.fleet.release(slot, job.id)
            self.by_node.get(job.status.node or "", set()).discard(job.id)
            self.wake.set()

    def _cache_request(self, job_id: JobId, request: JobRequest, size: int) -> None:
        if size <= REQUEST_CACHE_ITEM and self.cached_bytes + size <= REQUEST_CACHE_BYTES:
            self.full_requests[job_id] = (request, size)
            self.cached_bytes += size

    def take_cached_request(self, job_id: JobId) -> JobRequest | None:
        entry = self.full_requests.pop(job_id, None)
        if entry is None:
            return None
        self.cached_bytes -= entry[1]
        return entry[0]

    # --- status writes ---------------------------------------------------------------------------
    async def _write(self, job: Job, status: JobStatus) -> bool:
        """Persist a job's new status; on a conflict reload it and report False."""
        ended = status.state in TERMINAL_STATES and job.status.state not in TERMINAL_STATES
        try:
            job.revision = await self.store.write_status(job.id, status, job.revision)
            self._replace_status(job, status)
        except Conflict as e:
            log.warning("%s; reloading it", e)
            self._replace_status(job, *(await self.store.status(job.id) or (job.status, job.revision)))
            return False
        if ended:
            await self.record_end(job)
        return True

    def _replace_status(self, job: Job, status: JobStatus, revision: int | None = None) -> None:
        self._count(job, -1)
        job.status = status
        job.revision = job.revision if revision is None else revision
        self._count(job, 1)

    async def record_end(self, job: Job) -> None:
        """A job that ended leaves the active set and enters the index in finishing order. Should either write
        fail, its record is already final: a scheduler taking over finds it active but ended, and does both."""
        self.finished.pop(job.id, None)
        self.finished[job.id] = time.monotonic()
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
        """Change a job's state if `when(status)` holds (checked under the job's lock); False if not written."""
        async with job.lock:
            if when is not None and not when(job.status):
                return False
            return await self.set_state_locked(job, state, message, **changes)

    async def set_state_locked(self, job: Job, state: JobState, message: str, **changes) -> bool:
        was_active = job.status.state in ACTIVE_STATES
        status = msgspec.structs.replace(job.status, state=state, message=message, updated=time.time(), **changes)
        if was_active and state not in ACTIVE_STATES:
            self._leave_slot(job)
        return await self._write(job, status)

    async def requeue(self, job: Job, why: str, when: Callable[[JobStatus], bool] | None = None, **changes) -> None:
        if await self.set_state(job, "queued", why, when=when, **UNPLACED, **changes):
            self.enqueue(job)
