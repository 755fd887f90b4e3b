"""How the fleet is shared among tenants, as the scheduler answers `jetlora tenants`: each tenant's weight, its
nominal (guaranteed) devices, what it may borrow beyond them, its fair share and what it holds now."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct, field

from schemas.jobs import TenantId

Sharing = Literal["fair", "fifo"]  # the scheduler's --sharing
AdminClass = Literal["above", "among"]  # the scheduler's --admin-class: admins' jobs before tenants, or as one more


class TenantsQuery(Struct, forbid_unknown_fields=True):
    """Ask for the tenants' shares (an admin sees every tenant, a tenant its own)."""


class TenantShare(Struct, kw_only=True):
    """One tenant's place in the fleet (devices; `tenant` None: admins' jobs)."""

    tenant: TenantId | None
    weight: float  # its weight in the weighted max-min (--quota T=weight:W)
    nominal: int  # devices it is guaranteed while it wants them (devices:N under fair sharing; a cap under fifo)
    borrow_limit: int | None  # devices it may hold beyond nominal (borrow:N); None: no limit
    fair_share: int  # devices the weighted max-min over the fleet gives it now, from every tenant's demand
    in_use: int  # devices its running jobs hold (a co-training group's device counts once)
    borrowed: int  # devices it holds beyond its nominal
    queued: int  # its jobs waiting for a device
    wanted: int  # devices its waiting jobs ask for
    smallest_wanted: int | None = None  # the fewest devices one of its waiting jobs asks for (None: none waits)


class TenantList(Struct, tag="tenants", tag_field="type", kw_only=True):
    """The tenants' shares: how the scheduler shares the fleet now, and each tenant with jobs or a quota."""

    sharing: Sharing
    admin_class: AdminClass
    devices: int  # devices in the fleet (live nodes)
    tenants: list[TenantShare] = field(default_factory=list)
