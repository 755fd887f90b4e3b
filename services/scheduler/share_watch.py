"""Whether the fair share holds, watched at every preemption check: how long a tenant below its share, with a waiting
job it is owed (one asking for no more devices than its share less what it holds), goes without it while another
tenant holds more than its share. Preemption should end such a wait within --min-run-s (the least a borrower runs
before its device may be taken back) and the time a pause takes to land; a stretch longer than that and the
scheduler's heartbeat window is logged, and the longest is in the leader's closing line (bench/fair_share.py and
bench/chaos.py check it against their bound). O(tenants) a check: it looks at no job."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from services.scheduler.core import SchedulerCore
from services.scheduler.sharing import ShareTable
from services.scheduler.tenancy import Tenant

log = logging.getLogger(__name__)


@dataclass
class Stretch:
    """A tenant's wait below its share while another held more than its own: since when, and the worst seen."""

    since: float  # monotonic
    held: int
    share: int
    over: Tenant  # a tenant over its share when it began


class ShareWatch:
    """The stretches under way, and the longest one that ended (or the longest under way, when asked)."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.waiting: dict[Tenant, Stretch] = {}
        self.longest_s = 0.0
        self.longest_of: Tenant = None
        self.logged = 0  # stretches past the allowance

    def allowance(self) -> float:
        """How long a tenant may wait below its share while another holds more: --min-run-s and a heartbeat window
        (the pause sent, the checkpoint stored, the device seen free)."""
        return self.core.cfg.min_run_s + self.core.cfg.window

    def observe(self, table: ShareTable, now: float | None = None) -> None:
        """One look at the shares (as they stand: devices whose pauses are under way still count as held)."""
        now = time.monotonic() if now is None else now
        book = self.core.book
        over = [t for t, share in table.share.items() if table.held.get(t, 0) > share]
        for t, share in table.share.items():
            held, smallest = table.held.get(t, 0), book.smallest(t)
            starved = smallest is not None and held + smallest <= share and any(o != t for o in over)
            if starved and t not in self.waiting:
                self.waiting[t] = Stretch(now, held, share, next(o for o in over if o != t))
            elif not starved and t in self.waiting:
                self._ended(t, self.waiting.pop(t), now)
        for t in [t for t in self.waiting if t not in table.share]:  # no job of it left
            self._ended(t, self.waiting.pop(t), now)

    def settled(self, now: float | None = None) -> None:
        """Nothing waits: every stretch ends."""
        now = time.monotonic() if now is None else now
        for t in list(self.waiting):
            self._ended(t, self.waiting.pop(t), now)

    def _ended(self, tenant: Tenant, stretch: Stretch, now: float) -> None:
        took = now - stretch.since
        if took > self.longest_s:
            self.longest_s, self.longest_of = took, tenant
        if took > self.allowance():
            self.logged += 1
            log.info(
                "fair share: tenant %s waited %.1fs below its share (%d of %d devices when it began) while %s held "
                "more than its own (allowed: %.1fs, --min-run-s and a heartbeat window)",
                tenant,
                took,
                stretch.held,
                stretch.share,
                stretch.over,
                self.allowance(),
            )

    def longest(self, now: float | None = None) -> tuple[float, Tenant]:
        """The longest stretch, ended or under way: (seconds, tenant)."""
        now = time.monotonic() if now is None else now
        best = (self.longest_s, self.longest_of)
        for t, stretch in self.waiting.items():
            if now - stretch.since > best[0]:
                best = (now - stretch.since, t)
        return best
