"""The scheduler service: lead while holding the lease, recover the jobs, run the endpoints and loops."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import nats.micro
from nats.js.errors import NotFoundError
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import names, nats_subjects
from schemas.job_status import TERMINAL_STATES
from services import __version__, bus, fanout
from services.jetstream_writer import JetStreamWriter
from services.aio import cancel_and_wait, sleep_unless_stopped, wait_first
from services.scheduler.api import SchedulerApi
from services.scheduler.core import STATES_REDELIVERED_S, SchedulerConfig, SchedulerCore
from services.scheduler.events import JobEvents
from services.scheduler.gc_pauses import GcPauses, release_when_quiet, settle_after_start
from services.scheduler.idempotency import IdempotencyKeys
from services.scheduler.index import JobIndex
from services.scheduler.lease import Lease, RenewalStats
from services.scheduler.migrate import migrate
from services.scheduler.liveness import Liveness
from services.scheduler.pausing import Pausing
from services.scheduler.placer import Placer
from services.scheduler.preemption import Preemption
from services.scheduler.reconcile import Reconcile
from services.scheduler.retention import Retention
from services.scheduler.store import JobStore
from services.scheduler.tenant_store import TenantStore

log = logging.getLogger(__name__)
RETRY_LEAD_S = 1.0  # after a failed start as leader (NATS away, the bucket unreadable)
LET_GO_S = 2.0  # how long a scheduler that stops leading waits to unsubscribe each of its endpoints
FINISH_S = 2.0  # how long a scheduler told to stop lets its parts finish what they are applying


def _never() -> bool:
    return False


class Scheduler:
    """One scheduler process: stands by until it holds the lease, then leads until it loses it or stops.

    Its state is one SchedulerCore; each part below holds that core (and the pausing part, where it pauses or
    resumes) and nothing else of the others."""

    def __init__(self, nc: Client, config: SchedulerConfig | None = None, holder: str | None = None) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.core = core = SchedulerCore(nc, config)
        self.cfg = core.cfg
        self.pausing = Pausing(core)
        self.placer = Placer(core)
        self.preemption = Preemption(core, self.pausing)
        self.events = JobEvents(core)
        self.liveness = Liveness(core, self.pausing)
        self.retention = Retention(core)
        self.reconcile = Reconcile(core)
        self.tenants = TenantStore(self.js, self.cfg, changed=lambda: core.wake.set())  # the quotas, edited live
        self.holder = holder or f"scheduler-{uuid.uuid4().hex[:8]}"
        self.leading = asyncio.Event()
        self.renewals = RenewalStats()
        self.gc = GcPauses()  # the collector's pauses while leading

    async def run(self, stop: asyncio.Event) -> None:
        core = self.core
        writer = JetStreamWriter(self.nc)  # the scheduler's writes: a third less CPU each than js.publish
        core.store = JobStore(self.js, await self.js.key_value(names.JOBS_KV), await self._idempotency_bucket(), writer)
        core.index = JobIndex(self.nc, writer)
        await core.store.prepare_bucket()
        await self.tenants.seed()
        self.api = SchedulerApi(core, self.pausing, IdempotencyKeys(core.store, self.cfg.idempotency_window_s))
        lease = Lease(await self.js.key_value(names.LEASE_KV), self.holder)
        tenants = asyncio.create_task(self.tenants.run(stop))
        try:
            await self._stand_by_and_lead(lease, stop)
        finally:
            await cancel_and_wait([tenants])
            await writer.close()

    async def _stand_by_and_lead(self, lease: Lease, stop: asyncio.Event) -> None:
        core = self.core
        while not stop.is_set():
            if not await lease.wait_for(stop):
                return
            log.info("%s holds the scheduler lease", self.holder)
            core.lost = asyncio.Event()
            try:
                fence = await core.store.take_term(self.holder, lease.valid)
                await lease.announce(fence.term)  # nodes refuse older terms' commands from here on
                core.term, core.lease_valid = fence.term, lease.valid
                await self._lead(lease, stop)
            except Exception as e:  # no error may leave the fleet without a scheduler: stand by and lead again
                log.error(
                    "could not lead (%s: %s); releasing the lease and trying again in %.0fs",
                    type(e).__name__,
                    e,
                    RETRY_LEAD_S,
                )
                await lease.release()
                await sleep_unless_stopped(stop, RETRY_LEAD_S)
            finally:
                self.leading.clear()
                core.store.fence, core.lease_valid = None, _never
                await cancel_and_wait(list(core.tasks))
                core.reset()
        await lease.release()

    async def _idempotency_bucket(self):
        """The bucket whose max age is this scheduler's idempotency window: a key expires when its window ends."""
        kv = await self.js.key_value(names.IDEMPOTENCY_KV)
        config = (await self.js.stream_info(nats_subjects.kv(names.IDEMPOTENCY_KV).stream)).config
        if config.max_age != self.cfg.idempotency_window_s:
            window = self.cfg.idempotency_window_s  # JetStream wants a duplicate window no longer than the max age
            await self.js.update_stream(
                config.evolve(max_age=window, duplicate_window=min(config.duplicate_window or window, window))
            )
        return kv

    async def _recover(self) -> None:
        """Rebuild the queue and the slots in use from the active jobs alone, however many finished ones the
        store holds (raises rather than read an error as empty)."""
        core = self.core
        if not await core.store.has_active_set():
            await migrate(core.store, core.index)
        active = await core.store.load_active()
        for stored, status, revision, job_id in sorted(active, key=lambda a: a[0].seq if a[0] else 0):
            if stored is None:  # marked, but its request was never stored: nothing to lead
                await core.store.unmark_active(job_id)
                continue
            job = core.adopt(stored, status, revision)
            if job.status.state in TERMINAL_STATES:  # it ended, but its index entries were not written
                await core.record_end(job)

    async def _lead(self, lease: Lease, stop: asyncio.Event) -> None:
        await self.tenants.ready()  # the tenants' quotas as the bucket holds them, before any placement
        await self._recover()
        settle_after_start()  # what the store's jobs made in memory stays out of later collections' walk
        lost = self.core.lost
        subs: list[Subscription | fanout.Listening] = [
            await fanout.listen(self.nc, names.HEARTBEATS_ALL, self.liveness.on_heartbeat),  # one subscription
            # with the registry's, which runs in this process
            await self.nc.subscribe(names.JOB_PROGRESS_ALL, cb=self.events.on_progress),
        ]
        await self._drop_old_consumers()
        states = await self.js.pull_subscribe(
            names.JOB_STATES_ALL,
            durable=names.SCHEDULER_CONSUMER,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                max_ack_pending=10_000,
                ack_wait=STATES_REDELIVERED_S,
            ),
        )  # a state not applied (NATS away) comes back within 5 s
        service = await nats.micro.add_service(
            self.nc, name=names.SCHEDULER_SERVICE, version=__version__, description="jetlora job scheduler"
        )
        api = service.add_group(name=names.API_GROUP)
        for name, subject, handler, concurrently in self.api.endpoints():
            await bus.add_endpoint(api, name, handler, subject, concurrently=concurrently)
        await self.nc.flush()  # the subscriptions are live on the server before anyone is told we lead
        self.leading.set()
        log.info("scheduler leading: %d jobs known, %d queued", len(self.core.jobs), len(self.core.queue))
        parts = [
            self._keep_lease(lease, lost, stop),
            self._step_down_at_deadline(lease, lost, stop),
            self.placer.run(lost, stop),
            self.preemption.run(lost, stop),
            self.liveness.watch(lost, stop),
            self.events.consume_states(states, lost, stop),
            self.retention.run(lost, stop),
            self.reconcile.run(lost, stop),
            release_when_quiet(lambda: len(self.core.queue) == 0, stop),
        ]
        tasks = [asyncio.create_task(self._part(part, lost)) for part in parts]
        try:
            with self.gc:
                await wait_first(lost, stop)
        finally:
            self.leading.clear()  # at once: what follows may wait on a server that is gone
            if not lost.is_set():  # stopping: each part finishes what it applies (a state event, its ack)
                await asyncio.wait(tasks, timeout=FINISH_S)
            await cancel_and_wait(tasks)
            for end in (service.stop(), *(sub.unsubscribe() for sub in subs), states.unsubscribe()):
                try:
                    await asyncio.wait_for(end, LET_GO_S)
                except Exception as e:  # NATS unreachable: the server drops them with the connection
                    log.debug("could not let go of an endpoint or subscription: %s", e)
        self._log_how_it_went()
        if lost.is_set() and not stop.is_set():
            log.error("stopped leading: %s", await lease.why_lost())

    def _log_how_it_went(self) -> None:
        """What the leading cost the loop: placement passes and lease renewals (bench/control_plane.py reads it)."""
        passes, renewals = self.placer.stats, self.renewals
        log.info(
            "leading ended: %d placement passes (longest %.1f ms, %d past their budget); %d lease renewals "
            "(%d late, the latest %.0f ms after it was due)",
            passes.passes,
            passes.longest_s * 1000,
            passes.cut_short,
            renewals.renewals,
            renewals.late,
            renewals.latest_s * 1000,
        )
        log.info(
            "garbage collection while leading: %s; placement passes without it: the longest %.1f ms, %d past their "
            "budget (%d passes a collection landed in); of CPU: the longest pass %.1f ms, %d passes past the budget",
            self.gc.line(),
            passes.longest_own_s * 1000,
            passes.own_cut_short,
            passes.collected_in,
            passes.longest_cpu_s * 1000,
            passes.cpu_cut_short,
        )
        if self.preemption.stats:
            log.info("preemptions: %s", ", ".join(f"{k} {v}" for k, v in sorted(self.preemption.stats.items())))
            watch = self.preemption.watch
            (waited, starved), (below, lagged) = watch.longest_now()
            log.info(
                "fair share: the longest wait of a tenant below its share for a device while another held more: "
                "%.1f s (tenant %s); %d past the allowance of %.1f s; the longest below its share: %.1f s (tenant %s)",
                waited,
                starved,
                watch.logged,
                watch.allowance(),
                below,
                lagged,
            )

    async def _drop_old_consumers(self) -> None:
        """Consumers of an earlier subject layout match nothing now; left alone they would only hold the stream."""
        for old in names.OLD_SCHEDULER_CONSUMERS:
            try:
                await self.js.delete_consumer(names.JOBS_STREAM, old)
                log.info("deleted the old state consumer %s (its subjects are gone)", old)
            except NotFoundError:
                pass

    @staticmethod
    async def _part(part, lost: asyncio.Event) -> None:
        """One of the leader's loops; one that fails ends this leadership loudly (the next one starts afresh)."""
        try:
            await part
        except Exception:
            log.exception("a part of the leading scheduler failed; it stops leading and stands by again")
            lost.set()

    async def _step_down_at_deadline(self, lease: Lease, lost: asyncio.Event, stop: asyncio.Event) -> None:
        """Stop leading the moment the lease's local deadline passes without a renewal: before any standby may
        take the lease (a renewal that succeeds moves the deadline on)."""
        while not lost.is_set():
            wait = lease.deadline - time.monotonic()
            if wait <= 0:
                log.error(
                    "the scheduler lease was last renewed %.1fs ago (stalled, or NATS unreachable): stepping down "
                    "before another scheduler may take it",
                    time.monotonic() - lease.renewed_at,
                )
                lost.set()
                return
            if await sleep_unless_stopped(stop, wait):
                return

    async def _keep_lease(self, lease: Lease, lost: asyncio.Event, stop: asyncio.Event) -> None:
        """Renew the lease every interval while leading, counting the renewals a busy loop made late."""
        while not lost.is_set():
            due = time.monotonic() + lease.interval
            if await sleep_unless_stopped(stop, lease.interval):
                return
            self.renewals.woke(time.monotonic() - due, lease.interval)
            try:
                ok = await lease.renew()
            except Exception as e:  # server unreachable: the lease may lapse; keep trying until the deadline
                log.warning("could not renew the scheduler lease (%s: %s)", type(e).__name__, e)
                continue
            if not ok:
                lost.set()
                return
            self.core.connected_at = lease.renewed_at
