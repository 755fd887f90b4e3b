"""Jobs waiting for a device, in priority-then-age order, with lazy removal."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Generator


class JobQueue:
    """A heap of (-priority, seq, job); jobs pinned to a node wait in that node's own heap."""

    def __init__(self) -> None:
        self._any: list[tuple[int, int, str]] = []
        self._pinned: dict[str, list[tuple[int, int, str]]] = {}
        self._queued: set[str] = set()

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, job: str) -> bool:
        return job in self._queued

    def push(self, job: str, priority: int, seq: int, node: str | None = None) -> None:
        heap = self._pinned.setdefault(node, []) if node else self._any
        heapq.heappush(heap, (-priority, seq, job))
        self._queued.add(job)

    def ids(self) -> set[str]:
        """The queued jobs (a live view: copy it to change the queue while iterating)."""
        return self._queued

    def discard(self, job: str) -> None:
        """Forget a job (cancelled, placed); its heap entry is dropped when it surfaces."""
        self._queued.discard(job)

    def pinned_nodes(self, among: Collection[str] | None = None) -> list[str]:
        """Nodes jobs wait for (of those `among`, when given: a pass over the fleet's nodes then costs what the
        smaller of the two holds, however many nodes nobody has seen jobs are pinned to)."""
        if among is None:
            return [n for n, h in self._pinned.items() if h]
        if len(among) < len(self._pinned):
            return [n for n in among if self._pinned.get(n)]
        return [n for n, h in self._pinned.items() if h and n in among]

    def take(
        self, fits: Callable[[str], bool], node: str | None = None, window: int = 64
    ) -> Generator[str, None, None]:
        """Yield queued jobs, best first, for which `fits(job)` placed them; give up after `window` that did not fit.

        Jobs that did not fit keep their place. Scanning stops at `window` misses so a queue
        full of jobs too big for today's fleet costs a bounded amount per pass (backfill window).
        """
        heap = self._pinned.get(node, []) if node else self._any
        missed: list[tuple] = []
        try:
            while heap and len(missed) < window:
                entry = heapq.heappop(heap)
                job = entry[2]
                if job not in self._queued:
                    continue
                if fits(job):
                    self._queued.discard(job)
                    yield job
                else:
                    missed.append(entry)
        finally:
            for entry in missed:
                heapq.heappush(heap, entry)
