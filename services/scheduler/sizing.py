"""`gpu_mib: 0` jobs sized before they are placed: the estimate of schemas/memory.py for the base model a node
advertises, and a refusal that says what to change when no device could hold it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from schemas.jobs import FieldError, JobRequest
from schemas.memory import estimate, what_would_fit
from services.scheduler.fleet import Fleet, SlotKey

log = logging.getLogger(__name__)


def size(fleet: Fleet, req: JobRequest, held_mib: Callable[[SlotKey], int]) -> tuple[JobRequest, list[FieldError]]:
    """The request with gpu_mib set to its estimate (when it asked for auto and its model's shape is known), or why
    no device can hold it."""
    if req.gpu_mib or req.accelerator != "gpu":
        return req, []
    shape = fleet.model_shape(req.base_dir, req.node)
    if shape is None:
        log.info("no node advertises %s (agent --model): a gpu_mib 0 job on it takes any free GPU", req.base_dir)
        return req, []
    need = estimate(shape, req)
    room, where = fleet.largest_room(req.devices, req.node, held_mib)
    if need.mib > room:
        fixes = what_would_fit(shape, req, room)
        return req, [
            FieldError(
                "gpu_mib",
                f"the job needs ~{need.mib:,} MiB ({need.why()}); the largest free is "
                f"{room:,} MiB ({where}): " + "; ".join(fixes) + "; or give gpu_mib if you know better",
            )
        ]
    return msgspec.structs.replace(req, gpu_mib=need.mib), []
