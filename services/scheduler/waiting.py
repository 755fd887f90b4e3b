"""Why a queued job waits: each node's reason, summed up as Kubernetes explains a pending pod
("0/12 nodes are available: 8 insufficient free memory, 3 busy, 1 draining"), with what would change it."""

from __future__ import annotations

from collections import Counter

import msgspec

from schemas.jobs import JobRequest
from schemas.job_status import JobSummary, NodeWhy, summarize
from services.scheduler import sharing
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.sharing import ShareTable
from services.scheduler.fleet import Fleet, NodeView

FITS = "fits"
RESTING = "did not answer its last assignments (resting)"  # services/scheduler/unanswered.py
KIND_NAMES = {"gpu": "GPU", "cpu": "offered CPU", "any": "device"}


def node_reason(
    fleet: Fleet, name: str, view: NodeView, req: JobRequest, kept_for: str | None, resting: bool = False
) -> str:
    """Why `req` cannot start on this node now, or FITS."""
    if view.heartbeat.draining:
        return "draining"
    if kept_for:
        return f"kept for multi-device job {kept_for}"
    if resting:
        return RESTING
    kinds = fleet.kinds(req.accelerator)
    devices = [d for d in view.devices.values() if d.kind in kinds]
    if not devices:
        return f"no {KIND_NAMES[req.accelerator]}"
    usable = [d for d in devices if not d.failed]
    if not usable:
        return "its devices failed"
    big = [d for d in usable if d.total_mib >= req.gpu_mib]
    if len(big) < req.devices:
        return "too small"
    idle = [d for d in big if not d.jobs and (name, d.index) not in fleet.reserved]
    if len(idle) < req.devices:
        return "busy"
    if all(d.reclaim_mib for d in idle):
        return "its serving engine wants memory back"
    if len([d for d in idle if d.free_mib >= req.gpu_mib and not d.reclaim_mib]) < req.devices:
        return "insufficient free memory"
    return FITS


def explain(
    fleet: Fleet, req: JobRequest, kept: dict[str, str], resting: dict[str, str] | None = None
) -> tuple[str, list[NodeWhy]]:
    """(one line, each node's reason) for a queued job; kept: node -> the multi-device job it is kept for; resting:
    node -> why no assignment goes there for now (Unanswered.resting_words)."""
    resting = resting or {}
    if req.node is not None and req.node not in fleet.nodes:
        return (
            f"waiting: node {req.node}, which the job is pinned to, is not known (no heartbeat from it); it "
            "starts when that node's agent runs, or submit it without `node`"
        ), []
    views = fleet.views(req.node)
    if not views:
        return (
            "waiting: no node is known yet; start `jetlora agent` on a GPU node (or with --offer-cpu to train "
            "on its CPU)"
        ), []
    why = [
        NodeWhy(node=name, reason=node_reason(fleet, name, view, req, kept.get(name), name in resting))
        for name, view in views
    ]
    counts = Counter(w.reason for w in why)
    if counts[FITS]:
        fitting = ", ".join(w.node for w in why if w.reason == FITS)
        return f"waiting: {fitting} could take it; it waits behind jobs of higher priority or submitted earlier", why
    parts = []
    for reason, count in counts.most_common():
        if reason == "insufficient free memory":
            reason += (
                f" (need {req.gpu_mib:,} MiB{'' if req.devices == 1 else f' on each of {req.devices}'}, "
                f"largest free {_largest_free(fleet, req):,})"
            )
        parts.append(f"{count} {reason}")
    summary = f"waiting: 0/{len(why)} nodes are available: {', '.join(parts)}"
    if counts[RESTING]:  # which node, how long, and until when
        summary += "; " + next(resting[w.node] for w in why if w.reason == RESTING)
    return summary + _fix(fleet, req, counts), why


def _largest_free(fleet: Fleet, req: JobRequest) -> int:
    kinds = fleet.kinds(req.accelerator)
    return max(
        (d.free_mib for _, v in fleet.views(req.node) for d in v.devices.values() if d.kind in kinds and not d.failed),
        default=0,
    )


def _fix(fleet: Fleet, req: JobRequest, counts: Counter) -> str:
    """What would change it, for the commonest causes."""
    lacking = counts[f"no {KIND_NAMES[req.accelerator]}"]
    if req.accelerator == "gpu" and lacking == sum(counts.values()):
        cpus = [name for name, view in fleet.views(req.node) if any(d.kind == "cpu" for d in view.devices.values())]
        if cpus and req.quantization != "nf4" and req.devices == 1:
            return (
                f"; no known node has a GPU: set accelerator to cpu or any to run on {cpus[0]}'s CPU now, or "
                "wait for a GPU node"
            )
        return "; no known node has a GPU: it starts when a GPU node's agent joins"
    if counts["too small"] == sum(counts.values()):
        return f"; no device has {req.gpu_mib:,} MiB in total: ask for less gpu_mib, or add a bigger GPU"
    if counts["busy"] + counts["insufficient free memory"]:
        return "; it starts when a job there ends or memory frees"
    return ""


def with_reason(message: str, reason: str) -> str:
    """A queued job's message with its waiting reason in place of the old one (what came before it, such as
    why it was re-queued, stays)."""
    cut = message.find("waiting")
    prefix = message[:cut] if cut >= 0 else (f"{message}; " if message else "")
    return prefix + reason


class WaitingReasons:
    """Why queued jobs wait, worked out when someone asks (a job, a listing, `why`), never written into the store:
    the reason follows live free memory, which changes at every heartbeat. One reason per kind of request per
    question, so a listing of many queued jobs costs one line each."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self._reasons: dict[tuple, str] = {}
        self._table: ShareTable | None = None

    def message(self, job: Job) -> str:
        """The job's message, with why it waits now in place of any earlier reason when it is queued."""
        if job.status.state != "queued" or job.placing:
            return job.status.message
        return with_reason(job.status.message, self.reason(job))

    def reason(self, job: Job) -> str:
        core = self.core
        req, tenant = job.stored.request, job.stored.tenant
        limit = core.cfg.cap(tenant)
        holding = core.devices_by_tenant[tenant] if tenant is not None else 0
        if limit is not None and holding + req.devices > limit:
            if core.cfg.sharing == "fifo":
                return (
                    f"waiting: tenant {tenant} holds {holding} of its {limit} devices (its quota); it starts when "
                    "one of its jobs ends"
                )
            quota = core.cfg.quota(tenant)
            return (
                f"waiting: tenant {tenant} holds {holding} of the {limit} devices it may hold (its quota: "
                f"{quota.nominal} nominal, borrow {quota.borrow}); it starts when one of its jobs ends"
            )
        shape = (
            req.accelerator,
            req.gpu_mib,
            req.devices,
            req.node,
            req.quantization,
            job.id if req.devices > 1 else None,
            tenant,  # a node kept for a gang is not kept from a tenant below its share (sharing.KeptNodes)
            req.priority,
        )
        if shape not in self._reasons:  # a multi-device job's own kept node is not a reason for it to wait
            self._reasons[shape] = explain(core.fleet, req, self._kept_from(job), core.unanswered.resting_words())[0]
        return self._reasons[shape] + self.share_note(tenant)

    def _kept_from(self, job: Job) -> dict[str, str]:
        """The nodes kept for a multi-device job that this job may not take (node -> that job)."""
        core, tenant = self.core, job.stored.tenant
        if not core.gang_holds:
            return {}
        share = self.table().share.get(tenant, 0) if core.cfg.sharing == "fair" else None
        nodes = sharing.KeptNodes(core, core.gang_holds).from_job(job, core.devices_by_tenant[tenant], share)
        return {n: core.gang_holds[n] for n in nodes}

    def table(self) -> ShareTable:
        """The shares, worked out once per question."""
        if self._table is None:
            self._table = sharing.shares(self.core)
        return self._table

    def share_note(self, tenant: str | None) -> str:
        """Under fair sharing, where the tenant stands against its share (once per question)."""
        core = self.core
        if core.cfg.sharing != "fair" or (tenant is None and core.cfg.admins_above):
            return ""
        held, share = self.table().held.get(tenant, 0), self.table().share.get(tenant, 0)
        who = f"tenant {tenant}" if tenant is not None else "admins"
        if held < share:
            return f"; {who} holds {held} of its fair share of {share} devices: it goes first, and takes devices back from tenants over theirs"
        return f"; {who} holds {held} devices, its fair share is {share}: tenants below theirs go first"

    def summary(self, job: Job) -> JobSummary:
        summary = summarize(job.stored, job.status)
        if job.status.state == "queued":
            summary = msgspec.structs.replace(summary, message=self.message(job))
        return summary
