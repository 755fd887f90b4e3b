"""Co-training groups as the scheduler holds them: a projection of the jobs' statuses (and of the placements being
written), and the questions placement asks of them: may this queued job join that running group, and does the
device have room for what it adds.

A group lives on one device of one node. Its device is held for the group (`holder`), not for one job: the group
keeps it while any member holds it, and gives it back when the last one leaves. Which jobs may share a group is
schemas/co_train.py's rule and the operator's --co-train policy."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from schemas.co_train import GroupKey, group_key, own_mib, shared_mib, why_alone
from schemas.jobs import JobRequest
from schemas.memory import Estimate, estimate
from services.scheduler.config import SchedulerConfig
from services.scheduler.placement import Fleet, SlotKey

log = logging.getLogger(__name__)


def holder(job_id: str, group: str | None) -> str:
    """Who a device is held for: the job's group when it trains in one, else the job."""
    return f"group {group}" if group else job_id


def new_group_id() -> str:
    return "cg-" + secrets.token_hex(4)


@dataclass
class CoGroup:
    """One co-training group: where it trains, what its jobs share, and who is in it."""

    id: str
    slot: SlotKey
    key: GroupKey
    tenant: str | None  # the tenant of the job that started it (the same-tenant policy admits only its jobs)
    base_mib: int = 0  # what the group holds once (the base, the CUDA context), when the model's shape is known
    members: dict[str, int] = field(default_factory=dict)  # job -> MiB it adds to the group (its own state)


class Groups:
    """The groups of the jobs in memory, by id."""

    def __init__(self) -> None:
        self.by_id: dict[str, CoGroup] = {}

    def join(
        self, group: str, slot: SlotKey, job_id: str, request: JobRequest, tenant: str | None, fleet: Fleet
    ) -> None:
        """The job holds (or is being placed on) the group's device; the first member makes the group."""
        g = self.by_id.get(group)
        if g is None:
            shape = fleet.model_shape(request.base_dir, slot[0])
            g = self.by_id[group] = CoGroup(
                group, slot, group_key(request, shape), tenant, base_need(request, fleet, slot)
            )
        elif g.slot != slot:
            log.error(
                "job %s joins group %s on %s device %d, but the group trains on %s device %d",
                job_id,
                group,
                *slot,
                *g.slot,
            )
        g.members[job_id] = own_need(request, fleet, slot)

    def leave(self, group: str, job_id: str) -> bool:
        """The job no longer holds the group's device; True when it was the last (the device goes back)."""
        g = self.by_id.get(group)
        if g is None:
            return True
        g.members.pop(job_id, None)
        if not g.members:
            del self.by_id[group]
            return True
        return False

    def on(self, slot: SlotKey) -> CoGroup | None:
        return next((g for g in self.by_id.values() if g.slot == slot), None)


def _estimate(request: JobRequest, fleet: Fleet, slot: SlotKey) -> Estimate | None:
    view = fleet.nodes.get(slot[0])
    shape = fleet.model_shape(request.base_dir, slot[0])
    dev = view.devices.get(slot[1]) if view else None
    return None if shape is None or dev is None else estimate(shape, request, dev.kind)


def own_need(request: JobRequest, fleet: Fleet, slot: SlotKey) -> int:
    """MiB a job adds to a group on `slot`: its estimate less the base and the CUDA context (the group holds those
    once); its whole gpu_mib when the node does not advertise the model's shape."""
    need = _estimate(request, fleet, slot)
    return request.gpu_mib if need is None else own_mib(need)


def base_need(request: JobRequest, fleet: Fleet, slot: SlotKey) -> int:
    """MiB a group started by this job holds once: its base weights and the CUDA context (0 when unknown: its first
    job's gpu_mib stands for all of it)."""
    need = _estimate(request, fleet, slot)
    return 0 if need is None else shared_mib(need)


def may_share(cfg: SchedulerConfig, request: JobRequest, tenant: str | None, other_tenant: str | None) -> bool:
    """Whether the policy and the job let it train in one process with a job of `other_tenant`."""
    if cfg.co_train == "off" or why_alone(request) is not None:
        return False
    return cfg.co_train == "any" or tenant == other_tenant


def find_group(
    groups: Groups, fleet: Fleet, cfg: SchedulerConfig, request: JobRequest, tenant: str | None
) -> tuple[CoGroup, int] | None:
    """A running group the job may join now, with the MiB it needs free there: the same base weights, precision
    and quantisation, the policy's tenants, a place left, and room on the device beyond what members placed since
    the node's last heartbeat will take. The fullest such group first (best fit)."""
    best: tuple[int, CoGroup, int] | None = None
    for g in groups.by_id.values():
        node, index = g.slot
        if request.node not in (None, node) or not may_share(cfg, request, tenant, g.tenant):
            continue
        if len(g.members) >= cfg.co_train_max or group_key(request, fleet.model_shape(request.base_dir, node)) != g.key:
            continue
        view = fleet.nodes.get(node)
        dev = view.devices.get(index) if view else None
        if view is None or dev is None or view.heartbeat.draining or dev.failed or dev.reclaim_mib:
            continue
        if dev.kind not in fleet.kinds(request.accelerator):
            continue
        need = own_need(request, fleet, g.slot)
        seen = {a.job for a in view.heartbeat.attempts if a.state == "running"}  # their memory is in free_mib
        pending = sum(mib for job, mib in g.members.items() if job not in seen)
        if not seen & g.members.keys():
            pending += g.base_mib  # the group's process has not loaded the base yet
        room = dev.free_mib - pending - need
        if room >= 0 and (best is None or room < best[0]):
            best = (room, g, need)
    return (best[1], best[2]) if best else None


def founders(queued: list[tuple[str, JobRequest, str | None]], cfg: SchedulerConfig) -> set[str]:
    """Of the queued jobs (id, request, tenant), those that start a new group when placed on a free device: each
    that another queued job could train with (the same base directory, precision, quantisation, and tenant as the
    policy wants). A job with nobody to share with trains alone, as it always has."""
    if cfg.co_train == "off":
        return set()
    buckets: dict[tuple, list[str]] = {}
    for job_id, request, tenant in queued:
        if why_alone(request) is None:
            who = tenant if cfg.co_train == "same-tenant" else ""
            key = (
                request.base_dir.rstrip("/"),
                request.train.precision,
                request.quantization,
                request.accelerator,
                who,
            )
            buckets.setdefault(key, []).append(job_id)
    return {job for jobs in buckets.values() if len(jobs) > 1 for job in jobs}


def co_train_note(groups: Groups, fleet: Fleet, cfg: SchedulerConfig, request: JobRequest, tenant: str | None) -> str:
    """For `jetlora why` of a queued job: whether it may co-train, and why no running group takes it now."""
    if cfg.co_train == "off":
        return ""
    if (alone := why_alone(request)) is not None:
        return f"; it trains alone: {alone}"
    reasons = []
    for g in groups.by_id.values():
        node, index = g.slot
        if group_key(request, fleet.model_shape(request.base_dir, node)) != g.key:
            continue
        if not may_share(cfg, request, tenant, g.tenant):
            reasons.append(f"group {g.id} on {node} is another tenant's (--co-train {cfg.co_train})")
        elif len(g.members) >= cfg.co_train_max:
            reasons.append(f"group {g.id} on {node} is full ({len(g.members)} jobs, --co-train-max)")
        else:
            view = fleet.nodes.get(node)
            dev = view.devices.get(index) if view else None
            free = dev.free_mib if dev else 0
            reasons.append(
                f"group {g.id} on {node} device {index} has {free:,} MiB free, the job would add "
                f"{own_need(request, fleet, g.slot):,}"
            )
    return "; " + "; ".join(reasons) if reasons else ""
