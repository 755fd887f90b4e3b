"""How a job paused for a device's serving engine is recorded (JobStatus.paused_by: "engine <node>/<device>"), and
the device read back from it: such a job waits for that engine to free the device."""

from __future__ import annotations

from services.scheduler.fleet import SlotKey


def engine_tag(slot: SlotKey) -> str:
    """How a pause for a device's serving engine is recorded (JobStatus.paused_by)."""
    return f"engine {slot[0]}/{slot[1]}"


def engine_slot(paused_by: str | None) -> SlotKey | None:
    """The device an engine pause names; None for any other pause."""
    if not paused_by or not paused_by.startswith("engine "):
        return None
    node, _, device = paused_by.removeprefix("engine ").rpartition("/")
    return (node, int(device)) if device.lstrip("-").isdigit() else None
