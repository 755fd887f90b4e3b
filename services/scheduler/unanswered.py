"""Nodes that did not answer their last assignments (no acceptance, no refusal: an agent whose endpoint is stuck, a
node cut off from the bus while its heartbeats still come): each such node is given no assignment for a while, the
while doubling with each assignment it leaves unanswered in a row (from the assignment timeout, capped at CAP_S),
so the jobs it would have taken go to other nodes meanwhile, and it is tried again less and less often rather than
every assignment timeout. The count is forgotten as soon as the node answers an assignment (accepting or
refusing). Heartbeats do not count: a node whose heartbeats come may still not hear its assignments."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from services import bus

log = logging.getLogger(__name__)

CAP_S = 60.0  # the longest a node that keeps not answering goes without being tried again


@dataclass
class Silence:
    misses: int  # assignments left unanswered in a row (those sent together, before the last miss, count once)
    since: float  # monotonic: when the last miss was counted
    until: float  # monotonic: no assignment goes to the node before this
    rest_s: float  # how long that is, from the last miss


class Unanswered:
    """The nodes resting after unanswered assignments, by name (only those: a node that answers is dropped)."""

    def __init__(self, first_s: float, cap_s: float = CAP_S, wake: Callable[[], object] | None = None) -> None:
        self.first_s, self.cap_s = max(first_s, 0.1), cap_s
        self.wake = wake  # a placement pass when a node's rest ends (nothing else may change then)
        self.nodes: dict[str, Silence] = {}

    def missed(self, node: str, sent: float, now: float | None = None) -> Silence:
        """The node left an assignment sent at `sent` unanswered: it rests twice as long as after its last miss
        (unless the assignment went out before that miss was counted: the jobs of one pass count once)."""
        now = time.monotonic() if now is None else now
        last = self.nodes.get(node)
        if last is not None and sent <= last.since:
            return last
        misses = last.misses + 1 if last is not None else 1
        rest_s = min(self.cap_s, self.first_s * 2 ** min(misses - 1, 30))
        silence = self.nodes[node] = Silence(misses, now, now + rest_s, rest_s)
        if self.wake is not None:
            asyncio.get_running_loop().call_later(rest_s, self.wake)
        return silence

    def no_answer(self, job: str, node: str, error: bus.RequestError, sent: float) -> str:
        """The assignment of `job`, sent at `sent`, got no answer it could read (`error`): the node rests (a request
        too large to send says nothing of the node); why the job is re-queued, in words."""
        if isinstance(error, bus.PayloadTooLarge):
            return str(error)
        self.missed(node, sent)
        log.warning("job %s: %s; %s", job, error, self.words(node))
        return f"{error}; {self.words(node)}"

    def answered(self, node: str) -> None:
        self.nodes.pop(node, None)

    def resting(self, now: float | None = None) -> frozenset[str]:
        """The nodes no assignment goes to now (nothing to compute when every node answers)."""
        if not self.nodes:
            return frozenset()
        now = time.monotonic() if now is None else now
        return frozenset(n for n, s in self.nodes.items() if s.until > now)

    def resting_words(self) -> dict[str, str]:
        """The nodes resting now, each with why (`jetlora why`: a job that may only go there waits for the rest)."""
        return {n: self.words(n) for n in self.resting()}

    def words(self, node: str) -> str:
        """Why no job goes to the node now, for a re-queued job's message and the scheduler's log."""
        s = self.nodes.get(node)
        if s is None:
            return f"node {node} answers its assignments"
        return (
            f"node {node} did not answer {s.misses} assignment{'s' if s.misses > 1 else ''} in a row: no job is "
            f"assigned there for {s.rest_s:.1f}s (doubling, up to {self.cap_s:.0f}s, until it answers one)"
        )
