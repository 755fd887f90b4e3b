"""What each tenant has in the scheduler's memory, counted as statuses change (never by a scan): its waiting jobs
and the devices they ask for, the distinct devices its active jobs hold, its running jobs in preemption's order,
and the queued jobs that could start a co-training group together."""

from __future__ import annotations

from collections import Counter
from typing import Any

from schemas.job_status import ACTIVE_STATES, JobStatus
from services.scheduler.grouping import FounderKey
from services.scheduler.running import RunningIndex

Tenant = str | None  # None: admins' jobs


def held(status: JobStatus) -> list[tuple[str, int]]:
    """The devices a status holds: an active job's one, or all of a multi-device job's; nothing otherwise."""
    if status.state not in ACTIVE_STATES or status.node is None or status.device is None:
        return []
    return [(status.node, d) for d in status.devices or [status.device]]


class TenantBook:
    """The tenants' counts; `count` moves a job in or out of them as one of its statuses stands."""

    def __init__(self) -> None:
        self.queued: Counter[Tenant] = Counter()  # jobs waiting for a device
        self.wanted: Counter[Tenant] = Counter()  # devices the waiting jobs ask for
        self.sizes: dict[Tenant, Counter[int]] = {}  # its waiting jobs by the devices each asks for
        self.devices: Counter[Tenant] = Counter()  # distinct devices its active jobs hold
        self.given: Counter[Tenant] = Counter()  # devices it came to hold, ever (share_watch: what a wait gained)
        self.let_go: Counter[Tenant] = Counter()  # devices it stopped holding, ever (its jobs ended, paused, moved)
        self.slots: Counter[tuple[Tenant, Any]] = Counter()  # (tenant, slot) -> its jobs there
        self.groupable: Counter[FounderKey] = Counter()  # queued jobs that could start a group together, by kind
        self.running = RunningIndex()

    def count(
        self, job: str, tenant: Tenant, devices: int, founder: FounderKey | None, status: JobStatus, sign: int
    ) -> None:
        """Count a job in (1) or out of (-1) its tenant's figures as `status` stands: a device counts once for a
        tenant however many of its jobs co-train there."""
        if status.state == "queued":
            self.queued[tenant] += sign
            self.wanted[tenant] += sign * devices
            sizes = self.sizes.get(tenant)
            if sizes is None:  # not setdefault: a Counter made and dropped at every count
                sizes = self.sizes[tenant] = Counter()
            sizes[devices] += sign
            if sizes[devices] <= 0:
                del sizes[devices]
            if founder is not None and not status.train_alone:
                self.groupable[founder] += sign
                if self.groupable[founder] <= 0:
                    del self.groupable[founder]
        elif status.state in ACTIVE_STATES:
            slots: list[Any] = held(status) or [(None, job)]  # an active job's status names its device
            for slot in slots:
                key = (tenant, slot)
                self.slots[key] += sign
                if self.slots[key] == (1 if sign > 0 else 0):
                    self.devices[tenant] += sign
                    (self.given if sign > 0 else self.let_go)[tenant] += 1
                if self.slots[key] <= 0:
                    del self.slots[key]

    def smallest(self, tenant: Tenant) -> int | None:
        """The fewest devices one of the tenant's waiting jobs asks for (None: none waits)."""
        sizes = self.sizes.get(tenant)
        return min(sizes) if sizes else None

    def tenants(self) -> set[Tenant]:
        """Tenants with jobs waiting or devices held."""
        return {t for t, n in self.queued.items() if n > 0} | {t for t, n in self.devices.items() if n > 0}
