"""Whether this node takes an assignment: the scheduler placed it from a heartbeat that may be out of date, so the
node checks again against its devices as they are now."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from schemas.nodes import Assignment, Device


def refusal(
    a: Assignment, devices: list[Device], running: Mapping[Any, Iterable[int]], reclaim: dict[int, int], draining: bool
) -> str | None:
    """Why the node refuses `a`, or None; running: each attempt here -> the devices it trains on (a repeated
    assignment of an attempt already running is the agent's to accept before asking this)."""
    if draining:
        return "the node is shutting down"
    if len(set(a.ranks)) != len(a.ranks) or len(a.ranks) != a.request.devices:
        return f"the job asks for {a.request.devices} devices and was given {a.ranks}"
    busy = {index for used in running.values() for index in used}
    for index in a.ranks:
        if reason := _device_refusal(a, index, devices, busy, reclaim):
            return reason
    return None


def _device_refusal(
    a: Assignment, index: int, devices: list[Device], busy: set[int], reclaim: dict[int, int]
) -> str | None:
    dev = next((d for d in devices if d.index == index), None)
    if dev is None:
        return f"no device {index} on this node"
    if index in busy:
        return f"device {index} is already training another job"
    if a.request.quantization == "nf4" and dev.kind != "cuda":
        return f"device {index} is a CPU; nf4 (4-bit) training needs a GPU"
    if len(a.ranks) > 1 and dev.kind != "cuda":
        return f"device {index} is a CPU; a job on several devices runs one rank per GPU"
    if reclaim.get(index):
        return f"device {index}'s serving engine wants {reclaim[index]} MiB back"
    need = a.request.gpu_mib if a.need_mib is None else a.need_mib
    if dev.free_mib < need:
        joining = f" to join co-training group {a.group}" if a.need_mib is not None else ""
        return f"device {index} has {dev.free_mib} MiB free, the job needs {need}{joining}"
    return None
