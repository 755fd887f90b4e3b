"""`gpu_mib: 0` jobs sized before they are placed: the estimate of schemas/memory.py for the base model a node
advertises, and a refusal that says what to change when no device could hold it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from schemas.jobs import FieldError, JobRequest
from schemas.memory import ModelShape, estimate, what_would_fit
from services.scheduler.placement import Fleet, SlotKey

log = logging.getLogger(__name__)


def advertised_shape(fleet: Fleet, base_dir: str, node: str | None = None) -> ModelShape | None:
    """The shape of the model at base_dir, from the heartbeats of the nodes that have it."""
    views = [fleet.nodes[node]] if node in fleet.nodes else [] if node else fleet.nodes.values()
    for view in views:
        for shape in view.heartbeat.models:
            if shape.dir.rstrip("/") == base_dir.rstrip("/"):
                return shape
    return None


def largest_room(fleet: Fleet, count: int, node: str | None, held_mib: Callable[[SlotKey], int]) -> tuple[int, str]:
    """The most memory `count` GPUs of one node would have once jetlora's jobs on them end (what serving engines
    hold stays held), and where: the count-th roomiest device of the best node."""
    best = (0, "no GPU node")
    for name, view in fleet.nodes.items():
        if node is not None and name != node:
            continue
        rooms = sorted((min(d.total_mib, d.free_mib + held_mib((name, d.index))), d.index)
                       for d in view.devices.values() if d.kind == "cuda")
        if len(rooms) >= count:
            room, index = rooms[-count]
            if room > best[0]:
                best = (room, f"{name} device {index}" if count == 1 else f"{count} devices of {name}")
    return best


def size(fleet: Fleet, req: JobRequest, held_mib: Callable[[SlotKey], int]) -> tuple[JobRequest, list[FieldError]]:
    """The request with gpu_mib set to its estimate (when it asked for auto and its model's shape is known), or why
    no device can hold it."""
    if req.gpu_mib or req.accelerator != "gpu":
        return req, []
    shape = advertised_shape(fleet, req.base_dir, req.node)
    if shape is None:
        log.info("no node advertises %s (agent --model): a gpu_mib 0 job on it takes any free GPU", req.base_dir)
        return req, []
    need = estimate(shape, req)
    room, where = largest_room(fleet, req.devices, req.node, held_mib)
    if need.mib > room:
        fixes = what_would_fit(shape, req, room)
        return req, [FieldError("gpu_mib", f"the job needs ~{need.mib:,} MiB ({need.why()}); the largest free is "
                                           f"{room:,} MiB ({where}): " + "; ".join(fixes)
                                           + "; or give gpu_mib if you know better")]
    return msgspec.structs.replace(req, gpu_mib=need.mib), []
