"""The running jobs of each tenant in the order preemption looks at them: lowest priority first, then the job that
would lose least (the latest checkpoint, or the latest start when none came since), so choosing victims never
scans a tenant's jobs.

A projection of the statuses like the rest of memory: a job enters when it runs, is re-filed when a checkpoint of
its attempt arrives, and leaves when it stops running."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from dataclasses import dataclass

from schemas.job_status import JobStatus


@dataclass
class Running:
    """A running job as preemption sees it."""

    tenant: str | None
    priority: int
    attempt: int
    started: float  # monotonic: when this attempt started running here (min-run counts from it)
    started_wall: float  # the same, by the wall clock
    anchor: float  # wall clock: the later of its start and its newest checkpoint (what a pause now would lose)


class RunningIndex:
    """Per tenant, per priority: (-anchor, job) sorted, so the job that loses least comes first."""

    def __init__(self) -> None:
        self.jobs: dict[str, Running] = {}
        self._by: dict[str | None, dict[int, list[tuple[float, str]]]] = {}

    def __contains__(self, job: str) -> bool:
        return job in self.jobs

    def update(self, job: str, tenant: str | None, priority: int, old: JobStatus | None, new: JobStatus) -> None:
        """The job's status went from `old` to `new`."""
        entry = self.jobs.get(job)
        if new.state != "running":
            if entry is not None:
                self._remove(job, entry)
            return
        newest = new.checkpoints[-1].created if new.checkpoints else 0.0
        if entry is not None and entry.attempt == new.attempt:
            if newest > entry.anchor:
                self._remove(job, entry)
                entry.anchor = newest
                self._add(job, entry)
            return
        if entry is not None:
            self._remove(job, entry)
        wall = time.time()
        self._add(job, Running(tenant, priority, new.attempt, time.monotonic(), wall, max(wall, newest)))

    def _add(self, job: str, entry: Running) -> None:
        self.jobs[job] = entry
        bisect.insort(self._by.setdefault(entry.tenant, {}).setdefault(entry.priority, []), (-entry.anchor, job))

    def _remove(self, job: str, entry: Running) -> None:
        del self.jobs[job]
        by_priority = self._by[entry.tenant]
        filed = by_priority[entry.priority]
        i = bisect.bisect_left(filed, (-entry.anchor, job))
        if i < len(filed) and filed[i] == (-entry.anchor, job):
            del filed[i]
        if not filed:
            del by_priority[entry.priority]
            if not by_priority:
                del self._by[entry.tenant]

    def of(self, tenant: str | None, below: int | None = None, settled: float = 0.0, scan: int = 0) -> Iterator[str]:
        """The tenant's running jobs, lowest priority first and within one the least loss first (of priority below
        `below` only, when given). With `settled` (wall clock) and `scan`, each priority's jobs anchored after
        `settled` (started or checkpointed since: some too young to preempt) are looked at `scan` at most, then it
        goes on from the first anchored before. A live view: do not change the index while iterating."""
        by_priority = self._by.get(tenant, {})
        for priority in sorted(by_priority):
            if below is not None and priority >= below:
                return
            filed = by_priority[priority]
            cut = bisect.bisect_left(filed, (-settled, "")) if settled else 0
            for i in range(min(cut, scan)) if settled else ():
                yield filed[i][1]
            for i in range(cut, len(filed)):
                yield filed[i][1]
