"""What a scheduler tells nodes (run this attempt; cancel, stop, pause or end one): every command carries the
sender's term, and is sent only while its lease is valid at the moment it goes out. An agent refuses a command of
a term older than the newest it has seen, so a scheduler deposed while it stalled cannot undo what its successor
decided (services/agent/term_fence.py)."""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

from schemas import names
from schemas.nodes import Assignment, Control
from services import bus
from services.scheduler.core import SchedulerCore

C = TypeVar("C", Assignment, Control)


class NotLeading(bus.RequestError):
    """The command was not sent: this scheduler's lease lapsed (it steps down)."""


async def send(
    core: SchedulerCore, node: str, kind: Literal["assign", "control"], command: C, reply_type, timeout: float = 0
):
    """Send `command` to the node under this scheduler's term; its reply. Raises NotLeading, or bus.RequestError
    when the node does not answer."""
    if not core.may_act():
        raise NotLeading(f"this scheduler no longer leads (term {core.term}); nothing was sent to node {node}")
    subject = names.node(node).assign if kind == "assign" else names.node(node).control
    fenced = msgspec.structs.replace(command, term=core.term)
    return await bus.request(core.nc, subject, fenced, reply_type, timeout=timeout or core.cfg.assign_timeout)
