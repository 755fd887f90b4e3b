"""Each tenant's fair share of the fleet now, from the core's counts (shares.py does the arithmetic): what placement
orders tenants by, what preemption compares, and what `jetlora tenants` shows.

Computed afresh when asked, from a few numbers per tenant kept as statuses change (TenantBook) and the fleet's
device count: O(tenants log tenants), never a look at a job. Admins' jobs (tenant None) are a tenant of their own
with --admin-weight when --admin-class is among; above, what they want comes off the top and the tenants share
the rest."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schemas.tenants import TenantList, TenantShare
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.shares import Claim, fair_shares
from services.scheduler.tenancy import Tenant


@dataclass
class ShareTable:
    """Shares, holdings and limits of the tenants with jobs (admins' under key None)."""

    capacity: int
    share: dict[Tenant, int]
    held: dict[Tenant, int]
    claims: dict[Tenant, Claim]

    def below(self, tenant: Tenant, adding: int = 0) -> bool:
        """Whether the tenant holding `adding` devices more would still be within its fair share."""
        return self.held.get(tenant, 0) + adding <= self.share.get(tenant, 0)

    def over(self, tenant: Tenant) -> int:
        """Devices the tenant holds beyond its fair share."""
        return max(0, self.held.get(tenant, 0) - self.share.get(tenant, 0))

    def ratio(self, tenant: Tenant) -> float:
        """Held over share: below 1, it is owed devices (the smallest is owed most)."""
        share = self.share.get(tenant, 0)
        return self.held.get(tenant, 0) / share if share else float("inf")

    def borrowing(self, tenant: Tenant) -> int:
        """Devices held beyond its nominal."""
        claim = self.claims.get(tenant)
        return max(0, self.held.get(tenant, 0) - (claim.nominal if claim else 0))


def shares(core: SchedulerCore, extra: tuple[Tenant, ...] = ()) -> ShareTable:
    """The shares now, of the tenants with jobs (and of `extra`)."""
    cfg, book = core.cfg, core.book
    capacity = core.fleet.device_count
    tenants = book.tenants() | set(extra)
    held = {t: book.devices[t] for t in tenants}
    share: dict[Tenant, int] = {}
    if cfg.admins_above and None in tenants:
        share[None] = min(capacity, held[None] + book.wanted[None])
        capacity -= share[None]
    claims = {}
    for t in tenants:
        if t is None and cfg.admins_above:
            continue
        quota = cfg.quota(t)
        claims[t] = Claim(
            weight=quota.weight,
            nominal=quota.nominal if t is not None else 0,
            cap=cfg.cap(t) if cfg.sharing == "fair" else quota.devices,
            demand=held[t] + book.wanted[t],
            held=held[t],
        )
    share.update(fair_shares(capacity, claims))
    return ShareTable(core.fleet.device_count, share, held, claims)


class KeptNodes:
    """The nodes kept for waiting multi-device jobs (node -> that job: the core's gang_holds), and those of them a
    job may not take a device on: each kept for another job of no lower priority, unless the job's tenant is owed
    the devices it asks for (holding them too stays within its fair share) and the gang is another tenant's. A node
    kept for a gang so never keeps a tenant below its share from a device; a gang's own tenant's smaller jobs still
    pass it by (fifo sharing, share None: kept from every job of no higher priority). Worked out once per kind of job
    (owed or not, its tenant when owed, its priority) until the kept nodes change (`changed`)."""

    def __init__(self, core: SchedulerCore, kept: Mapping[str, str]) -> None:
        self.core, self.kept = core, kept
        self._of: dict[tuple[bool, Tenant, int], frozenset[str]] = {}

    def changed(self) -> None:
        """A node was kept, or let go: what each kind of job may not take is worked out afresh."""
        self._of.clear()

    def from_job(self, job: Job, holding: int, share: int | None) -> frozenset[str]:
        """The kept nodes `job` may not take a device on (its own, when it is a gang with one, excepted)."""
        if not self.kept:
            return frozenset()
        tenant, req = job.stored.tenant, job.stored.request
        owed = share is not None and holding + req.devices <= share
        key = (owed, tenant if owed else None, req.priority)
        nodes = self._of.get(key)
        if nodes is None:
            nodes = self._of[key] = frozenset(self._kept_from(owed, tenant, req.priority))
        if req.devices > 1 and job.id in self.kept.values():
            nodes = frozenset(n for n in nodes if self.kept[n] != job.id)
        return nodes

    def _kept_from(self, owed: bool, tenant: Tenant, priority: int):
        jobs = self.core.jobs
        for node, gang_id in self.kept.items():
            gang = jobs.get(gang_id)
            if gang is None or gang.stored.request.priority < priority:
                continue
            if owed and gang.stored.tenant != tenant:
                continue
            yield node


def tenant_list(core: SchedulerCore, tenant: str | None) -> TenantList:
    """`jetlora tenants`: every tenant with jobs or a quota (an admin), or the asking tenant's own row."""
    cfg = core.cfg
    named = tuple(cfg.quotas) if tenant is None else (tenant,)
    table = shares(core, named)
    rows = []
    for t in sorted(table.share, key=lambda t: (t is not None, t or "")):
        if tenant is not None and t != tenant:
            continue
        quota = cfg.quota(t)
        nominal = quota.nominal if t is not None else 0
        rows.append(
            TenantShare(
                tenant=t,
                weight=quota.weight,
                nominal=nominal,
                borrow_limit=quota.borrow if cfg.sharing == "fair" else 0,
                fair_share=table.share[t],
                in_use=table.held.get(t, 0),
                borrowed=max(0, table.held.get(t, 0) - nominal),
                queued=core.book.queued[t],
                wanted=core.book.wanted[t],
                smallest_wanted=core.book.smallest(t),
            )
        )
    return TenantList(sharing=cfg.sharing, admin_class=cfg.admin_class, devices=table.capacity, tenants=rows)
