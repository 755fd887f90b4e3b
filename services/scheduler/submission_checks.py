"""What a submission is checked against before it is stored: whether any known device could ever hold it, the
tenant's queued-jobs quota, and how much memory each device's jetlora jobs would give back (for sizing)."""

from __future__ import annotations

from collections.abc import Mapping

from schemas.jobs import FieldError, JobRequest
from services.scheduler.core import SchedulerCore


def capacity_errors(core: SchedulerCore, req: JobRequest) -> list[FieldError]:
    """A job no known device could ever hold is refused now rather than queued forever."""
    if not core.fleet.nodes or (req.node and req.node not in core.fleet.nodes):
        return []
    best = core.fleet.largest(req.accelerator, req.node)
    where = f"node {req.node}" if req.node else "any known node"
    if best is None:
        kind = {"gpu": "a GPU", "cpu": "an offered CPU", "any": "a device"}[req.accelerator]
        lack = f"node {req.node} has no {kind}" if req.node else f"no known node has {kind}"
        if req.quantization == "nf4":  # the field the submitter chose for the GPU
            return [
                FieldError(
                    "quantization",
                    f"nf4 needs a GPU and {lack}; add a GPU node, or set "
                    "quantization to 'none' and accelerator to 'cpu'",
                )
            ]
        return [FieldError("accelerator", f"{lack}; choose another accelerator or node")]
    node, dev = best
    if dev.total_mib < req.gpu_mib:
        return [
            FieldError(
                "gpu_mib",
                f"{req.gpu_mib} MiB is more than {where} has: the largest is {node} device "
                f"{dev.index} ({dev.name or dev.kind}) with {dev.total_mib} MiB total, {dev.free_mib} MiB free; "
                "ask for less or add a bigger GPU",
            )
        ]
    if req.devices > 1:
        most, name = core.fleet.most_devices(req.gpu_mib, req.accelerator, req.node)
        if most < req.devices:
            has = f"{name} has {most}" if name else "none has one"
            return [
                FieldError(
                    "devices",
                    f"{req.devices} devices with {req.gpu_mib} MiB each must be on one node, "
                    f"and of {where} {has}; ask for fewer devices or less gpu_mib",
                )
            ]
    return []


def quota_errors(core: SchedulerCore, tenant: str | None, admitting: Mapping[str | None, int]) -> list[FieldError]:
    """The tenant's queued quota, counting its submissions being stored (`admitting`) as queued already."""
    limit = core.cfg.quota(tenant).queued
    if limit is None or (queued := core.queued_by_tenant[tenant] + admitting.get(tenant, 0)) < limit:
        return []
    return [
        FieldError(
            "",
            f"tenant {tenant} has {queued} jobs waiting for a device, its quota is {limit}; "
            "submit again once some have started, or ask an admin to raise the quota",
        )
    ]


def held_mib(core: SchedulerCore, slot) -> int:
    """What the jetlora job on a device was placed for (it gives that back when it ends)."""
    group = core.groups.on(slot)
    if group is not None:
        return sum(core.jobs[j].stored.request.gpu_mib for j in group.members if j in core.jobs)
    job = core.jobs.get(core.fleet.reserved.get(slot, ""))
    return job.stored.request.gpu_mib if job else 0
