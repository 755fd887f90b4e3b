"""Whether the fair share holds, watched at every preemption check (the invariant bench/fair_share.py and
bench/chaos.py check against their bound):

  A tenant is *starved* while it holds fewer devices than its fair share, one of its waiting jobs asks for no more
  than it is owed (held + the smallest waiting job's devices <= share), and another tenant holds more than its own
  share. Its *wait* is the time it stays starved while the scheduler does nothing that brings it nearer its share: it
  begins when the tenant becomes starved, and begins afresh each time the tenant holds more than the most it held
  since the wait began, or preemption plans devices for it (the scheduler acted: what it takes back lands within
  the allowance). The tenant's own jobs ending and being replaced one for one, while another holds more than its
  share, is no progress, however the looks fall between the ends and the replacements (the rule before, "more than
  the fewest it held", took each replacement a look had seen missing for a gain, so a scheduler that never
  preempted passed while the starved tenant's jobs were short); a tenant whose short jobs end faster than
  preemption is planned for it is starved, and the allowance is what preemption has to act in.

Preemption should end such a wait within --min-run-s (the least a borrower runs before its device may be taken
back) and the time a pause takes to land; a wait longer than that and the scheduler's heartbeat window is logged
with what happened in it (the devices the tenant was given and let go, and the devices preemption planned for it:
none planned means the scheduler found nothing to take), and the longest is in the leader's closing line. Beside
it, how long a tenant stayed below its share at all, gaining or not: a large burst takes as long as its devices
take to be freed one by one. O(tenants) a check: it looks at no job."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from services.scheduler.core import SchedulerCore
from services.scheduler.sharing import ShareTable
from services.scheduler.tenancy import Tenant

log = logging.getLogger(__name__)


@dataclass
class Stretch:
    """A tenant below its share while another held more than its own: since when it gained no device (and how many
    it held then), since when it is below its share, and a tenant over its share when the wait began."""

    since: float  # monotonic
    held: int  # the most it held since the wait began (a gain: more than this)
    share: int
    over: Tenant
    below_since: float
    given: int = 0  # the tenant's book.given, let_go and the watch's planned as the wait began
    let_go: int = 0
    planned: int = 0


class ShareWatch:
    """The stretches under way, and the longest ones seen."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.waiting: dict[Tenant, Stretch] = {}
        self.longest: tuple[float, Tenant] = (0.0, None)  # a wait without a device gained, ended
        self.longest_below: tuple[float, Tenant] = (0.0, None)  # below its share at all, ended
        self.logged = 0  # waits past the allowance
        self.planned: Counter[Tenant] = Counter()  # devices preemption planned for each tenant, ever (preemption.py)

    def allowance(self) -> float:
        """How long a tenant may wait for a device below its share while another holds more: --min-run-s and a
        heartbeat window (the pause sent, the checkpoint stored, the device seen free)."""
        return self.core.cfg.min_run_s + self.core.cfg.window

    def observe(self, table: ShareTable, now: float | None = None) -> None:
        """One look at the shares (as they stand: devices whose pauses are under way still count as held)."""
        now = time.monotonic() if now is None else now
        book = self.core.book
        over = [t for t, share in table.share.items() if table.held.get(t, 0) > share]
        for t, share in table.share.items():
            held, smallest = table.held.get(t, 0), book.smallest(t)
            starved = smallest is not None and held + smallest <= share and any(o != t for o in over)
            stretch = self.waiting.get(t)
            if starved and stretch is None:
                over_t = next(o for o in over if o != t)
                self.waiting[t] = Stretch(now, held, share, over_t, now, *self._marks(t))
            elif starved and stretch is not None and (held > stretch.held or self.planned[t] > stretch.planned):
                self._waited(t, stretch, now)  # it gained, or preemption acted for it: a new wait begins
                stretch.since, stretch.held, stretch.share = now, held, share
                stretch.given, stretch.let_go, stretch.planned = self._marks(t)
            elif not starved and stretch is not None:
                self._ended(t, self.waiting.pop(t), now)
        for t in [t for t in self.waiting if t not in table.share]:  # no job of it left
            self._ended(t, self.waiting.pop(t), now)

    def _marks(self, tenant: Tenant) -> tuple[int, int, int]:
        book = self.core.book
        return book.given[tenant], book.let_go[tenant], self.planned[tenant]

    def restart(self) -> None:
        """A new term of leading: the stretches under way when the last one ended are forgotten, not carried on. A
        standby looks at no share, and a wait that began before it stood by was not a wait while it did (the first
        check after a term of standing by had logged the whole of it: a 101.5 s wait in bench/chaos.py's fair-share
        mix, all but 2 s of it led by the other scheduler); the longest ones seen stay."""
        self.waiting.clear()

    def settled(self, now: float | None = None) -> None:
        """Nothing waits: every stretch ends."""
        now = time.monotonic() if now is None else now
        for t in list(self.waiting):
            self._ended(t, self.waiting.pop(t), now)

    def _ended(self, tenant: Tenant, stretch: Stretch, now: float) -> None:
        self._waited(tenant, stretch, now)
        self.longest_below = max(self.longest_below, (now - stretch.below_since, tenant), key=lambda lt: lt[0])

    def _waited(self, tenant: Tenant, stretch: Stretch, now: float) -> None:
        took = now - stretch.since
        self.longest = max(self.longest, (took, tenant), key=lambda lt: lt[0])
        if took > self.allowance():
            given, let_go, planned = (
                m - s for m, s in zip(self._marks(tenant), (stretch.given, stretch.let_go, stretch.planned))
            )
            self.logged += 1
            log.info(
                "fair share: tenant %s waited %.1fs below its share with no device gained nor planned for it (at most %d of %d) while "
                "%s held more than its own (allowed: %.1fs, --min-run-s and a heartbeat window); in the wait it was "
                "given %d devices and let go %d, and preemption planned %d for it",
                tenant,
                took,
                stretch.held,
                stretch.share,
                stretch.over,
                self.allowance(),
                given,
                let_go,
                planned,
            )

    def longest_now(self, now: float | None = None) -> tuple[tuple[float, Tenant], tuple[float, Tenant]]:
        """(the longest wait without a device gained, the longest below its share), ended or under way."""
        now = time.monotonic() if now is None else now
        waited, below = self.longest, self.longest_below
        for t, stretch in self.waiting.items():
            waited = max(waited, (now - stretch.since, t), key=lambda lt: lt[0])
            below = max(below, (now - stretch.below_since, t), key=lambda lt: lt[0])
        return waited, below
