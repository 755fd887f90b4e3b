"""The scheduler's request endpoints: take a job in (submission.py), answer queries, cancel, stop, pause or resume
one."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from schemas import subject_parts
from schemas.jobs import Error, FieldError, Rejected
from schemas.job_status import ACTIVE_STATES, TERMINAL_STATES, JobList, JobListQuery, JobQuery, JobReply, JobWhy
from schemas.datasets import PinningQuery
from schemas.events import CheckpointList, EventPage, EventsQuery
from schemas.nodes import Control, ControlReply, NodeInfo, NodeList
from schemas.validate import InvalidRequest
from services import bus
from schemas.tenants import TenantList, TenantsQuery
from services.scheduler import commands, listing, references, sharing
from services.scheduler.grouping import co_train_note
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.history import events_page
from services.scheduler.idempotency import IdempotencyKeys
from services.scheduler.pausing import BY_USER, Pausing
from services.scheduler.submission import Submissions
from services.scheduler.waiting import WaitingReasons, explain, with_reason

log = logging.getLogger(__name__)
Handler = Callable[[Any], Awaitable[Any]]  # bus.handler(): answers, and returns an error reply's description


class SchedulerApi:
    """The scheduler's request endpoints: every handler takes a typed request and returns its reply (bus.handler
    does the rest)."""

    def __init__(self, core: SchedulerCore, pausing: Pausing, idempotency: IdempotencyKeys) -> None:
        self.core, self.pausing, self.idempotency = core, pausing, idempotency
        cfg = core.cfg
        per_tenant: dict[str, Any] = dict(
            per_key=cfg.requests_per_tenant,
            queued_per_key=cfg.queued_requests_per_tenant,
            queued_bytes_per_key=cfg.queued_request_bytes_per_tenant,
            key=subject_parts.asker_of_subject,
        )
        self._submitting = bus.Concurrently(core.spawn, cfg.max_concurrent_submits, **per_tenant)
        self._answering = bus.Concurrently(core.spawn, cfg.max_concurrent_submits, **per_tenant)
        self.submissions = Submissions(core, idempotency)
        self._pinning = functools.partial(references.pinning, core)  # which unfinished jobs name a dataset

    def endpoints(self) -> list[tuple[str, str, Handler, bus.Concurrently | None]]:
        """(endpoint name, subject under names.API_GROUP, handler, how it runs): an admin's verbs, which see every
        job, and each tenant's (jetlora.api.<tenant>.<verb>), which see the tenant's own. Every request is answered
        in a task of its own, a bounded number per tenant at once, so a slow one (a node that does not answer a
        cancel, a long page of events) never holds up another tenant's."""
        verbs: dict[str, tuple[type, Callable[..., Awaitable[Any]]]] = {
            "cancel": (JobQuery, lambda q, tenant: self._end_early(q, "cancel", tenant)),
            "stop": (JobQuery, lambda q, tenant: self._end_early(q, "stop", tenant)),
            "job": (JobQuery, self._get_job),
            "jobs": (JobListQuery, self._list_jobs),
            "pause": (JobQuery, self._pause_job),
            "resume": (JobQuery, self._resume_job),
            "events": (EventsQuery, self._job_events),
            "checkpoints": (JobQuery, self._job_checkpoints),
            "why": (JobQuery, self._why_job),
            "tenants": (TenantsQuery, self._tenants),
        }
        submit = bus.handler(
            self.submissions.accept, parse=Submissions.parse_with_size, invalid=Rejected, with_subject=True
        )
        out: list[tuple[str, str, Handler, bus.Concurrently | None]] = [
            ("submit", "submit", submit, self._submitting),
            ("tenant-submit", "*.submit", submit, self._submitting),
            ("nodes", "nodes", bus.handler(self._list_nodes, msgspec.Raw), self._answering),
            ("pinning", "pinning", bus.handler(self._pinning, PinningQuery), self._answering),  # an admin's only
        ]
        for verb, (request_type, serve) in verbs.items():
            answer = bus.handler(
                lambda q, subject, serve=serve: serve(q, bus.tenant_of(subject)), request_type, with_subject=True
            )
            out += [(verb, verb, answer, self._answering), (f"tenant-{verb}", f"*.{verb}", answer, self._answering)]
        return out

    # --- queries ---------------------------------------------------------------------------------
    async def _job(self, q: JobQuery, tenant: str | None) -> Job:
        job = await self.core.lookup(q.job)
        if job is None or (tenant is not None and job.stored.tenant != tenant):  # another tenant's is not there
            raise InvalidRequest([FieldError("job", f"no job {q.job}; `jetlora jobs` lists them")])
        return job

    def _reply(self, job: Job) -> JobReply:
        return JobReply(WaitingReasons(self.core).summary(job))

    async def _get_job(self, q: JobQuery, tenant: str | None) -> JobReply:
        return self._reply(await self._job(q, tenant))

    async def _list_jobs(self, q: JobListQuery, tenant: str | None) -> JobList:
        core = self.core
        if q.state is not None and q.state not in TERMINAL_STATES:  # only active jobs are in it: all in memory
            page = listing.from_memory(core.jobs.values(), q, tenant)
        else:
            page = await listing.from_index(core.index, core.store, core.jobs, q, tenant)
        reasons = WaitingReasons(core)
        for i, summary in enumerate(page.jobs):
            if summary.state == "queued" and (job := core.jobs.get(summary.id)) is not None:
                page.jobs[i] = msgspec.structs.replace(summary, message=reasons.message(job))
        return page

    async def _list_nodes(self, _query) -> NodeList:
        core = self.core
        now = time.monotonic()
        nodes = []
        for view in core.fleet.nodes.values():
            hb = view.heartbeat
            nodes.append(
                NodeInfo(
                    node=hb.node,
                    alive=now - view.last_seen < core.cfg.window,
                    last_seen=view.last_seen_wall,
                    agent_version=hb.agent_version,
                    devices=list(view.devices.values()),
                    offers_cpu=hb.offers_cpu,
                    no_gpu_reason=hb.no_gpu_reason,
                    running=hb.running,
                    engines=hb.engines,
                    attempts=hb.attempts,
                )
            )
        return NodeList(nodes)

    async def _job_events(self, q: EventsQuery, tenant: str | None) -> EventPage:
        job = await self._job(JobQuery(q.job), tenant)
        return await events_page(self.core.js, q, job.status, job.stored.tenant)

    async def _why_job(self, q: JobQuery, tenant: str | None) -> JobWhy:
        core = self.core
        job = await self._job(q, tenant)
        if job.status.state != "queued" or job.placing:
            where = f" on {job.status.node}" if job.status.node and job.status.state in ACTIVE_STATES else ""
            where += f" in co-training group {job.status.group}" if where and job.status.group else ""
            return JobWhy(
                job=job.id, state=job.status.state, summary=f"{job.status.state}{where}: {job.status.message}"
            )
        summary, nodes = explain(
            core.fleet,
            job.stored.request,
            {n: j for n, j in core.gang_holds.items() if j != job.id},
            core.unanswered.resting_words(),
        )
        reasons = WaitingReasons(core)
        reason = reasons.reason(job)
        if not reason.startswith("waiting: tenant"):
            reason = summary + co_train_note(core.groups, core.cfg, job.stored.request, job.stored.tenant, job.status)
            reason += reasons.share_note(job.stored.tenant)
        return JobWhy(job=job.id, state="queued", summary=with_reason(job.status.message, reason), nodes=nodes)

    async def _tenants(self, _query: TenantsQuery, tenant: str | None) -> TenantList:
        return sharing.tenant_list(self.core, tenant)

    async def _job_checkpoints(self, q: JobQuery, tenant: str | None) -> CheckpointList:
        return CheckpointList(job=q.job, checkpoints=(await self._job(q, tenant)).status.checkpoints)

    # --- pause and resume --------------------------------------------------------------------------
    async def _pause_job(self, q: JobQuery, tenant: str | None) -> JobReply | Error:
        job = await self._job(q, tenant)
        if job.status.state == "paused":
            return Error(f"job {job.id} is already paused; `jetlora resume {job.id}` goes on with it", field="job")
        return await self.pausing.pause(job, BY_USER) or self._reply(job)

    async def _resume_job(self, q: JobQuery, tenant: str | None) -> JobReply | Error:
        job = await self._job(q, tenant)
        where = f"from checkpoint {job.status.checkpoint}" if job.status.checkpoint else "from the start"
        return await self.pausing.resume(job, f"resumed {where}; waiting for a device") or self._reply(job)

    # --- cancel and stop -------------------------------------------------------------------------
    async def _end_early(self, q: JobQuery, action: str, tenant: str | None) -> JobReply | Error:
        core = self.core
        job = await self._job(q, tenant)
        state = job.status.state
        if state in TERMINAL_STATES:
            return Error(f"job {job.id} already ended ({state})", field="job")
        if state == "paused":
            if action == "stop":
                return Error(
                    f"job {job.id} is paused: resume it to go on and stop it later, or cancel it (its "
                    "checkpoints stay in the store)",
                    field="job",
                )
            if not await core.set_state(job, "cancelled", "cancelled while paused", when=lambda s: s.state == "paused"):
                return Error(f"job {job.id} was just resumed; ask again", field="job")
        elif state == "queued":
            if not await core.set_state(
                job, "cancelled", f"{action} asked while queued", when=lambda s: s.state == "queued"
            ):
                return Error(f"job {job.id} was just placed; ask again", field="job")
        elif error := await self._ask_node(job, action):
            return error
        return self._reply(job)

    async def _ask_node(self, job: Job, action: str) -> Error | None:
        """Cancel or stop a running attempt through its node. A node that does not answer has its attempt marked
        cancelled (if it is still the job's, and still running: a job that ended meanwhile keeps its end); the
        node ends it when it is heard again."""
        core, node, attempt = self.core, job.status.node, job.status.attempt
        try:
            reply = await commands.send(
                core,
                node or "",
                "control",
                Control(job.id, action, attempt=attempt),  # type: ignore[arg-type]
                ControlReply,
            )
            return None if reply.ok else Error(reply.message)
        except commands.NotLeading as e:
            return Error(f"{e}; ask again: the next scheduler to lead answers")
        except bus.RequestError as e:
            log.warning("node %s did not answer %s of %s (%s); marking it cancelled", node, action, job.id, e)
        await core.set_state(
            job,
            "cancelled",
            f"{action} asked; node {node} did not answer (it ends the job's attempt {attempt} when it is heard again)",
            when=lambda s: s.state in ACTIVE_STATES and s.attempt == attempt and s.node == node,
        )
        return None
