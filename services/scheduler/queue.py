"""Jobs waiting for a device, in priority-then-age order, with lazy removal: one queue for everyone (fifo sharing),
or one per tenant (fair sharing), which placement visits in the order of their shares."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Collection, Generator, Iterator
from typing import Any

REBUILD_SLACK = 64  # a heap is rebuilt once its entries of jobs gone outnumber its jobs by this and more
PASSED_OVER = 16  # jobs a walk may pass over at no cost (fits() said None), per job of its window


class JobQueue:
    """A heap of (-priority, seq, job); jobs pinned to a node wait in that node's own heap.

    Removal is lazy (an entry whose job left the queue is dropped when it surfaces), but what the heaps hold stays
    bounded by the jobs waiting: a node's heap goes with its last job (jobs pinned to nodes nobody has seen, then
    cancelled, would otherwise leave a heap each for good), and a heap grown past twice its jobs is rebuilt."""

    def __init__(self) -> None:
        self._any: list[tuple[int, int, str]] = []
        self._pinned: dict[str, list[tuple[int, int, str]]] = {}
        self._queued: dict[str, str] = {}  # job -> the node it waits for ("": any node)
        self._waiting: Counter[str] = Counter()  # node ("": any node) -> its jobs queued
        self.heaps_dropped = 0  # nodes' heaps given up as their last job left

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, job: str) -> bool:
        return job in self._queued

    def push(self, job: str, priority: int, seq: int, node: str | None = None) -> None:
        heapq.heappush(self._heap(node or "", create=True), (-priority, seq, job))
        if job not in self._queued:
            self._queued[job] = node or ""
            self._waiting[node or ""] += 1

    def ids(self) -> Collection[str]:
        """The queued jobs (a live view: copy it to change the queue while iterating)."""
        return self._queued.keys()

    def discard(self, job: str) -> None:
        """Forget a job (cancelled, placed); its heap entry is dropped when it surfaces, or with its heap."""
        node = self._queued.pop(job, None)
        if node is None:
            return
        self._waiting[node] -= 1
        if self._waiting[node] > 0:
            heap = self._heap(node)
            if len(heap) > 2 * self._waiting[node] + REBUILD_SLACK:
                heap[:] = [e for e in heap if self._queued.get(e[2]) == node]  # in place: a pass may be reading it
                heapq.heapify(heap)
            return
        del self._waiting[node]
        if node:
            del self._pinned[node]
            self.heaps_dropped += 1
        else:
            self._any.clear()

    def pinned_heaps(self) -> int:
        """Nodes' heaps held: one per node jobs wait for, none left by jobs gone."""
        return len(self._pinned)

    def _heap(self, node: str, create: bool = False) -> list[tuple[int, int, str]]:
        if not node:
            return self._any
        return self._pinned.setdefault(node, []) if create else self._pinned.get(node, [])

    def _put_back(self, node: str, entries: list[tuple[int, int, str]]) -> None:
        """Entries a walk popped go back to their node's heap (as it is now), those of jobs still queued."""
        for entry in entries:
            if entry[2] in self._queued:
                heapq.heappush(self._heap(node, create=True), entry)

    def pinned_nodes(self, among: Collection[str] | None = None) -> list[str]:
        """Nodes jobs wait for (of those `among`, when given: a pass over the fleet's nodes then costs what the
        smaller of the two holds, however many nodes nobody has seen jobs are pinned to)."""
        if among is None:
            return [n for n, h in self._pinned.items() if h]
        if len(among) < len(self._pinned):
            return [n for n in among if self._pinned.get(n)]
        return [n for n, h in self._pinned.items() if h and n in among]

    def peek(self, node: str | None = None) -> Generator[str, None, None]:
        """The queued jobs not pinned to a node (those pinned to `node`, when given), best first, popped only as far
        as the caller reads (each keeps its place: close the generator, as contextlib.closing does, to put them
        back)."""
        heap, popped = self._heap(node or ""), []
        try:
            while heap:
                entry = heapq.heappop(heap)
                if entry[2] in self._queued:
                    popped.append(entry)
                    yield entry[2]
        finally:
            self._put_back(node or "", popped)

    def take(
        self,
        fits: Callable[[str], bool | None],
        node: str | None = None,
        window: int = 64,
        until: Callable[[], bool] | None = None,
    ) -> Generator[str, None, None]:
        """Yield queued jobs, best first, for which `fits(job)` placed them; give up after `window` that did not fit,
        or once `until()` says the queue has had enough for now.

        Jobs that did not fit keep their place. Scanning stops at `window` misses so a queue
        full of jobs too big for today's fleet costs a bounded amount per pass (backfill window). A job fits() passed
        over at no cost (None: one of its shape found no room in this pass already) counts not as a miss, up to
        PASSED_OVER x window of them: 100 multi-device jobs at a tenant's head no longer hid its 1-device jobs from
        idle devices.
        """
        heap = self._heap(node or "")
        missed: list[tuple[int, int, str]] = []  # every job that did not fit (each keeps its place)
        misses, passed = 0, 0  # those that counted against the window; those passed over at no cost
        try:
            while heap and misses < window and not (until is not None and until()):
                entry = heapq.heappop(heap)
                job = entry[2]
                if job not in self._queued:
                    continue
                placed = fits(job)
                if placed:
                    self.discard(job)
                    yield job
                    continue
                missed.append(entry)
                if placed is None and passed < PASSED_OVER * window:
                    passed += 1
                else:
                    misses += 1
        finally:
            self._put_back(node or "", missed)


ALL: Any = ("all tenants",)  # the one queue's key under fifo sharing
_NONE: Any = object()  # no queue's key


class TenantQueues:
    """The queued jobs, in one JobQueue per tenant (per_tenant), or in one for all (priority then age across
    tenants, as under fifo sharing)."""

    def __init__(self, per_tenant: bool) -> None:
        self.per_tenant = per_tenant
        self.queues: dict[Any, JobQueue] = {}
        self._key_of: dict[str, Any] = {}  # job -> the key of the queue it waits in

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, job: str) -> bool:
        return job in self._key_of

    def key(self, tenant: str | None) -> Any:
        return tenant if self.per_tenant else ALL

    def of(self, tenant: str | None) -> JobQueue | None:
        """The queue the tenant's jobs wait in."""
        return self.queues.get(self.key(tenant))

    def push(self, job: str, priority: int, seq: int, node: str | None, tenant: str | None) -> None:
        key = self.key(tenant)
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = JobQueue()
        queue.push(job, priority, seq, node)
        self._key_of[job] = key

    def discard(self, job: str) -> None:
        key = self._key_of.pop(job, _NONE)
        if key is not _NONE:  # None is a key too: the queue of jobs with no tenant, under fair sharing
            self.queues[key].discard(job)

    def ids(self) -> Collection[str]:
        """The queued jobs (a live view: copy it to change the queue while iterating)."""
        return self._key_of.keys()

    def waiting(self) -> Iterator[tuple[Any, JobQueue]]:
        """(key, queue) of the queues with jobs in them."""
        return ((k, q) for k, q in self.queues.items() if len(q))

    def pinned_heaps(self) -> int:
        """The nodes' heaps the queues hold (see JobQueue.pinned_heaps)."""
        return sum(q.pinned_heaps() for q in self.queues.values())

    def pinned_nodes(self, among: Collection[str] | None = None) -> list[str]:
        """Nodes some tenant's jobs wait for (see JobQueue.pinned_nodes)."""
        if len(self.queues) == 1:
            return next(iter(self.queues.values())).pinned_nodes(among)
        return list(dict.fromkeys(n for q in self.queues.values() for n in q.pinned_nodes(among)))
