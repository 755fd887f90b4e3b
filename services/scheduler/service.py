"""The scheduler service: the request endpoints, heartbeats, job states and the placement loop."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec
import nats.micro
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import names
from schemas.events import Progress, StateChange
from schemas.jobs import (ACTIVE_STATES, TERMINAL_STATES, Accepted, Error, FieldError, JobList, JobListQuery,
                          JobQuery, JobReply, JobRequest, JobStatus, Rejected, StoredRequest, check_request,
                          decode_error_field, summarize)
from schemas.nodes import Assignment, AssignRefused, AssignReply, Control, ControlReply, Heartbeat, NodeInfo, NodeList
from services import __version__, bus
from services.scheduler.lease import Lease
from services.scheduler.placement import Fleet, SlotKey
from services.scheduler.queue import JobQueue
from services.scheduler.store import Conflict, JobStore

log = logging.getLogger(__name__)
REQUEST_CACHE_BYTES = 64 * 2**20  # full requests of queued jobs kept in memory, so placing one needs no KV read
REQUEST_CACHE_ITEM = 64 * 2**10
_enc = msgspec.json.Encoder()


@dataclass
class Job:
    """What the scheduler holds in memory of a job: its request without the data, and its status."""

    stored: StoredRequest
    status: JobStatus
    revision: int = 0
    assigned_at: float = 0.0  # monotonic
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one status write at a time, each from the latest
    suspect: bool = False  # a check that its node lost it is under way

    @property
    def slot(self) -> SlotKey | None:
        s = self.status
        return (s.node, s.device) if s.node is not None and s.device is not None else None


@dataclass
class SchedulerConfig:
    heartbeat_interval: float = 1.0
    misses: int = 3
    assign_timeout: float = 2.0
    backfill_window: int = 64
    max_concurrent_submits: int = 256

    @property
    def window(self) -> float:
        return self.heartbeat_interval * self.misses


class Scheduler:
    def __init__(self, nc: Client, config: SchedulerConfig | None = None, holder: str | None = None) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.cfg = config or SchedulerConfig()
        self.holder = holder or f"scheduler-{uuid.uuid4().hex[:8]}"
        self.leading = asyncio.Event()
        self._reset()

    def _reset(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.queue = JobQueue()
        self.fleet = Fleet()
        self.by_node: dict[str, set[str]] = {}
        self.awaited: dict[str, float] = {}  # nodes with jobs at recovery, not heard since: deadline
        self.seq = 0
        self.full_requests: dict[str, tuple[JobRequest, int]] = {}  # job -> (request with data, its size)
        self.cached_bytes = 0
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._submit_slots = asyncio.Semaphore(self.cfg.max_concurrent_submits)

    # --- lifecycle ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        kv = await self.js.key_value(names.JOBS_KV)
        self.store = JobStore(kv)
        lease = Lease(await self.js.key_value(names.LEASE_KV), self.holder)
        while not stop.is_set():
            if not await lease.wait_for(stop):
                return
            log.info("%s holds the scheduler lease", self.holder)
            try:
                await self._lead(lease, stop)
            finally:
                self.leading.clear()
                for t in list(self._tasks):
                    t.cancel()
                self._reset()
        await lease.release()

    async def _lead(self, lease: Lease, stop: asyncio.Event) -> None:
        await self._recover()
        lost = asyncio.Event()
        subs = [
            await self.nc.subscribe(names.HEARTBEATS_ALL, cb=self._on_heartbeat),
            await self.nc.subscribe(names.JOB_PROGRESS_ALL, cb=self._on_progress),
        ]
        states = await self.js.pull_subscribe(
            names.JOB_STATES_ALL, durable=names.SCHEDULER_CONSUMER,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, max_ack_pending=10_000,
                                  ack_wait=5.0))  # a state not applied (NATS away) comes back within 5 s
        service = await nats.micro.add_service(self.nc, name=names.SCHEDULER_SERVICE, version=__version__,
                                               description="jetlora job scheduler")
        api = service.add_group(name=names.API_GROUP)
        for name, handler in (("submit", self._submit), ("cancel", self._cancel), ("stop", self._stop),
                              ("job", self._get_job), ("jobs", self._list_jobs), ("nodes", self._list_nodes)):
            await api.add_endpoint(name=name, handler=handler)
        await self.nc.flush()  # the subscriptions are live on the server before anyone is told we lead
        self.leading.set()
        log.info("scheduler leading: %d jobs known, %d queued", len(self.jobs), len(self.queue))
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._keep_lease(lease, lost, stop))
                tg.create_task(self._placer(lost, stop))
                tg.create_task(self._watch_liveness(lost, stop))
                tg.create_task(self._consume_states(states, lost, stop))
        finally:
            await service.stop()
            for sub in subs:
                await sub.unsubscribe()
            await states.unsubscribe()
        if lost.is_set() and not stop.is_set():
            log.error("lost the scheduler lease (another scheduler took over); standing by")

    async def _keep_lease(self, lease: Lease, lost: asyncio.Event, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await _sleep_until(stop, lease.ttl / 3)
            if stop.is_set():
                return
            try:
                ok = await lease.renew()
            except Exception as e:  # server unreachable: the lease may lapse; keep trying until it does
                log.warning("could not renew the scheduler lease: %s", e)
                continue
            if not ok:
                lost.set()
                return

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception():
            log.error("scheduler task failed: %r", task.exception(), exc_info=task.exception())

    async def _recover(self) -> None:
        """Rebuild the queue and the slots in use from the jobs bucket."""
        requests, statuses = await self.store.load()
        now = time.monotonic()
        for job_id, stored in sorted(requests.items(), key=lambda kv: kv[1].seq):
            status, rev = statuses.get(job_id, (JobStatus(updated=stored.created), 0))
            job = Job(stored, status, rev, assigned_at=now)
            self.jobs[job_id] = job
            self.seq = max(self.seq, stored.seq)
            if status.state == "queued":
                self._enqueue(job)
            elif status.state in ACTIVE_STATES and job.slot:
                self.fleet.reserve(job.slot, job_id)
                self.by_node.setdefault(status.node, set()).add(job_id)
                self.awaited.setdefault(status.node, now + self.cfg.window)

    # --- submission and queries ----------------------------------------------------------------
    async def _submit(self, req) -> None:
        await self._submit_slots.acquire()
        self._spawn(self._submit_one(req))

    async def _submit_one(self, req) -> None:
        try:
            reply = await self._accept(req.data)
            await req.respond(_enc.encode(reply))
        finally:
            self._submit_slots.release()

    async def _accept(self, data: bytes) -> Accepted | Rejected:
        try:
            request = msgspec.json.decode(data, type=JobRequest)
        except msgspec.ValidationError as e:
            return Rejected([decode_error_field(e)])
        except msgspec.DecodeError as e:
            return Rejected([FieldError("", f"the request is not valid JSON ({e}); send a JSON object with model, base_dir and data")])
        errors = check_request(request) + self._capacity_errors(request)
        if errors:
            return Rejected(errors)
        self.seq += 1
        stored = StoredRequest(id=uuid.uuid4().hex[:16], request=request, created=time.time(), seq=self.seq)
        try:
            await self.store.add(stored)  # durable before the reply: a crash after it loses nothing
        except Exception as e:
            return Rejected([FieldError("", f"the job could not be stored ({type(e).__name__}: JetStream unavailable?); "
                                            "nothing was queued: submit it again")])
        job = Job(msgspec.structs.replace(stored, request=msgspec.structs.replace(request, data=[])),
                  JobStatus(updated=stored.created, message="waiting for a device"))
        self.jobs[stored.id] = job
        if len(data) <= REQUEST_CACHE_ITEM and self.cached_bytes + len(data) <= REQUEST_CACHE_BYTES:
            self.full_requests[stored.id] = (request, len(data))
            self.cached_bytes += len(data)
        self._enqueue(job)
        return Accepted(stored.id)

    def _full_request_cached(self, job_id: str) -> JobRequest | None:
        entry = self.full_requests.pop(job_id, None)
        if entry is None:
            return None
        self.cached_bytes -= entry[1]
        return entry[0]

    def _capacity_errors(self, req: JobRequest) -> list[FieldError]:
        """A job no known device could ever hold is refused now rather than queued forever."""
        if not self.fleet.nodes or (req.node and req.node not in self.fleet.nodes):
            return []
        best = self.fleet.largest(req.accelerator, req.node)
        where = f"node {req.node}" if req.node else "any known node"
        if best is None:
            kind = {"gpu": "a GPU", "cpu": "an offered CPU", "any": "a device"}[req.accelerator]
            return [FieldError("accelerator", f"{where} has no {kind}; choose another accelerator or node")]
        node, dev = best
        if dev.total_mib < req.gpu_mib:
            return [FieldError("gpu_mib", f"{req.gpu_mib} MiB is more than {where} has: the largest is {node} device "
                               f"{dev.index} ({dev.name or dev.kind}) with {dev.total_mib} MiB total, {dev.free_mib} MiB free; "
                               "ask for less or add a bigger GPU")]
        return []

    async def _get_job(self, req) -> None:
        job = self._job_from(req)
        if isinstance(job, Error):
            return await req.respond(_enc.encode(job))
        await req.respond(_enc.encode(JobReply(summarize(job.stored, job.status))))

    async def _list_jobs(self, req) -> None:
        try:
            q = msgspec.json.decode(req.data or b"{}", type=JobListQuery)
        except msgspec.DecodeError as e:
            return await req.respond(_enc.encode(Error(str(e))))
        out = [summarize(j.stored, j.status) for j in self.jobs.values()
               if (q.state is None or j.status.state == q.state) and (q.node is None or j.status.node == q.node)]
        await req.respond(_enc.encode(JobList(out[-q.limit:])))

    async def _list_nodes(self, req) -> None:
        nodes = []
        now = time.monotonic()
        for view in self.fleet.nodes.values():
            hb = view.heartbeat
            nodes.append(NodeInfo(node=hb.node, alive=now - view.last_seen < self.cfg.window, last_seen=view.last_seen_wall,
                                  agent_version=hb.agent_version, devices=list(view.devices.values()),
                                  offers_cpu=hb.offers_cpu, no_gpu_reason=hb.no_gpu_reason, running=hb.running))
        await req.respond(_enc.encode(NodeList(nodes)))

    def _job_from(self, req) -> Job | Error:
        try:
            q = msgspec.json.decode(req.data, type=JobQuery)
        except msgspec.DecodeError as e:
            return Error(f"{e}; send {{\"job\": \"<id>\"}}", field="job")
        job = self.jobs.get(q.job)
        return job if job else Error(f"no job {q.job}; `jetlora jobs` lists them", field="job")

    async def _cancel(self, req) -> None:
        await req.respond(_enc.encode(await self._end_early(req, "cancel")))

    async def _stop(self, req) -> None:
        await req.respond(_enc.encode(await self._end_early(req, "stop")))

    async def _end_early(self, req, action: str) -> JobReply | Error:
        job = self._job_from(req)
        if isinstance(job, Error):
            return job
        state = job.status.state
        if state in TERMINAL_STATES:
            return Error(f"job {job.stored.id} already ended ({state})", field="job")
        if state == "queued":
            self.queue.discard(job.stored.id)
            self._full_request_cached(job.stored.id)
            if not await self._set_state(job, "cancelled", f"{action} asked while queued",
                                         when=lambda s: s.state == "queued"):
                return Error(f"job {job.stored.id} was just placed; ask again", field="job")
        else:
            try:
                reply = await bus.request(self.nc, names.control(job.status.node), Control(job.stored.id, action),
                                          ControlReply, timeout=self.cfg.assign_timeout)
                if not reply.ok:
                    return Error(reply.message)
            except bus.RequestError as e:
                log.warning("node %s did not answer %s of %s (%s); marking it cancelled", job.status.node, action,
                            job.stored.id, e)
                await self._set_state(job, "cancelled", f"{action} asked; node {job.status.node} did not answer")
        return JobReply(summarize(job.stored, job.status))

    # --- state -------------------------------------------------------------------------------
    def _enqueue(self, job: Job) -> None:
        self.queue.push(job.stored.id, job.stored.request.priority, job.stored.seq, job.stored.request.node)
        self._wake.set()

    def _leave_slot(self, job: Job) -> None:
        if job.slot:
            self.fleet.release(job.slot, job.stored.id)
            self.by_node.get(job.status.node, set()).discard(job.stored.id)
            self._wake.set()

    async def _write(self, job: Job, status: JobStatus) -> bool:
        """Persist a job's new status; on a conflict reload it and report False."""
        try:
            job.revision = await self.store.write_status(job.stored.id, status, job.revision)
            job.status = status
            return True
        except Conflict as e:
            log.warning("%s; reloading it", e)
            entry = await self.store.kv.get(f"status.{job.stored.id}")
            job.status, job.revision = msgspec.json.decode(entry.value, type=JobStatus), entry.revision
            return False

    async def _set_state(self, job: Job, state: str, message: str, when=None, **changes) -> bool:
        """Change a job's state if `when(status)` holds (checked under the job's lock); False if not written."""
        async with job.lock:
            if when is not None and not when(job.status):
                return False
            return await self._set_state_locked(job, state, message, **changes)

    async def _set_state_locked(self, job: Job, state: str, message: str, **changes) -> bool:
        was_active = job.status.state in ACTIVE_STATES
        status = msgspec.structs.replace(job.status, state=state, message=message, updated=time.time(), **changes)
        if was_active and state not in ACTIVE_STATES:
            self._leave_slot(job)
        return await self._write(job, status)

    # --- placement ---------------------------------------------------------------------------
    async def _placer(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        async def wake_on_end():
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            self._wake.set()

        self._spawn(wake_on_end())
        while not (stop.is_set() or lost.is_set()):
            await self._wake.wait()
            self._wake.clear()
            self._place_pass()
            await asyncio.sleep(0)  # let heartbeats and submissions in between passes

    def _place_pass(self) -> None:
        def fits(node=None):
            def try_place(job_id: str) -> bool:
                job = self.jobs[job_id]
                req = job.stored.request
                slot = self.fleet.find(req.gpu_mib, req.accelerator, node)
                if slot is None:
                    return False
                self.fleet.reserve(slot, job_id)
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

    async def _assign(self, job: Job) -> None:
        node, device = job.slot
        attempt = job.status.attempt + 1
        self.by_node.setdefault(node, set()).add(job.stored.id)
        job.assigned_at = time.monotonic()
        try:
            written = await self._set_state(job, "assigned", f"assigned to {node} device {device}", attempt=attempt,
                                            when=lambda s: s.state == "queued")
        except Exception as e:  # JetStream away: the job stays queued, the slot free
            log.warning("could not record the assignment of %s (%s); it stays queued", job.stored.id, e)
            written = False
            job.status = msgspec.structs.replace(job.status, node=None, device=None)
            self._enqueue(job)
        if not written:
            self.fleet.release((node, device), job.stored.id)
            return
        try:
            request = self._full_request_cached(job.stored.id) or (await self.store.request(job.stored.id)).request
            reply = await bus.request(self.nc, names.assign(node),
                                      Assignment(job=job.stored.id, device=device, attempt=attempt, request=request,
                                                 resume_from=job.status.checkpoint),
                                      AssignReply, timeout=self.cfg.assign_timeout)
        except bus.RequestError as e:
            reply = AssignRefused(job.stored.id, str(e))
        if isinstance(reply, AssignRefused):
            log.info("node %s refused job %s: %s; re-queued", node, job.stored.id, reply.reason)
            await self._requeue(job, f"node {node} refused it ({reply.reason}); waiting for a device",
                                when=lambda s: s.state == "assigned" and s.attempt == attempt)

    async def _requeue(self, job: Job, why: str, when=None, **changes) -> None:
        if await self._set_state(job, "queued", why, when=when, node=None, device=None, **changes):
            self._enqueue(job)

    # --- what agents tell ----------------------------------------------------------------------
    async def _on_heartbeat(self, msg) -> None:
        try:
            hb = msgspec.json.decode(msg.data, type=Heartbeat)
        except msgspec.DecodeError as e:
            log.warning("dropped a heartbeat on %s that did not decode: %s", msg.subject, e)
            return
        if hb.node != names.node_of_subject(msg.subject):
            log.warning("dropped a heartbeat for node %s sent on %s", hb.node, msg.subject)
            return
        self.awaited.pop(hb.node, None)
        if self.fleet.heard(hb):
            self._wake.set()
        self._reconcile(hb)

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

    async def _on_progress(self, msg) -> None:
        try:
            p = msgspec.json.decode(msg.data, type=Progress)
        except msgspec.DecodeError:
            return
        job = self.jobs.get(names.job_of_subject(msg.subject))
        if job and job.status.state in ACTIVE_STATES:
            job.status = msgspec.structs.replace(job.status, step=p.step, steps=p.steps,
                                                 loss=p.loss if p.loss is not None else job.status.loss,
                                                 peak_mib=p.peak_mib if p.peak_mib is not None else job.status.peak_mib)

    async def _consume_states(self, sub, lost: asyncio.Event, stop: asyncio.Event) -> None:
        while not (stop.is_set() or lost.is_set()):
            try:
                msgs = await sub.fetch(batch=256, timeout=0.5)
            except NatsTimeout:
                continue
            except Exception as e:
                log.warning("reading job states: %s", e)
                await asyncio.sleep(0.2)
                continue
            # one job's events in order; different jobs' at once
            by_job = defaultdict(list)
            for msg in msgs:
                by_job[names.job_of_subject(msg.subject)].append(msg)

            async def apply_in_order(batch):
                for m in batch:
                    try:
                        await self._apply_state(m)
                        await m.ack()
                    except Exception as e:  # not acked: JetStream delivers it again
                        log.warning("could not apply a job state yet (%s); it will be redelivered", e)
                        return

            await asyncio.gather(*(apply_in_order(b) for b in by_job.values()))

    async def _apply_state(self, msg) -> None:
        try:
            ev = msgspec.json.decode(msg.data, type=StateChange)
        except msgspec.DecodeError as e:
            log.warning("ignored a job state on %s that did not decode: %s", msg.subject, e)
            return
        job = self.jobs.get(ev.job)
        if job is None:
            return

        def current(s: JobStatus) -> bool:  # not from an earlier attempt, not after the end, not a repeat
            return (ev.attempt == s.attempt and s.state not in TERMINAL_STATES
                    and (ev.state, ev.message) != (s.state, s.message))

        if ev.state == "queued":  # the agent handed it back (shutting down) before it could finish
            return await self._requeue(job, ev.message, when=current)
        checkpoints = [a.name for a in ev.artifacts if a.kind == "checkpoint"]
        artifacts = [a for a in ev.artifacts if a.kind != "checkpoint"] or job.status.artifacts
        await self._set_state(job, ev.state, ev.message, when=current, artifacts=artifacts,
                              checkpoint=checkpoints[-1] if checkpoints else job.status.checkpoint)

    # --- liveness ----------------------------------------------------------------------------
    async def _watch_liveness(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        tick = min(0.1, self.cfg.heartbeat_interval / 4)
        cut_off = False
        while not (stop.is_set() or lost.is_set()):
            await _sleep_until(stop, tick)
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
                if await self._set_state_locked(job, "queued", f"{why}; re-queued{retry}", node=None, device=None,
                                                retries_used=used):
                    self._enqueue(job)
            else:
                await self._set_state_locked(job, "failed", why)


async def _sleep_until(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass
