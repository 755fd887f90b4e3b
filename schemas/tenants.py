"""How the fleet is shared among tenants, as the scheduler answers `jetlora tenants`: each tenant's weight, its
nominal (guaranteed) devices, what it may borrow beyond them, its fair share and what it holds now; and each
tenant's quota as stored in names.TENANTS_KV (the end of this module), which `jetlora tenants set|rm` edits live."""

from __future__ import annotations

import math
from typing import Literal

from msgspec import Struct, field

from schemas.jobs import PRIORITY_MAX, PRIORITY_MIN, TenantId
from schemas.validate import FieldError

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


# --- the bucket (names.TENANTS_KV) as stored: `tenant.<name>` (TenantRecord); `seeded` once a scheduler's --quota
# flags were written into it (its first start: later starts never write over what is stored)

QUEUED_DEFAULT = 10_000  # a tenant's waiting jobs unless its quota says otherwise: what one tenant can make the
# scheduler hold is bounded (an admin's are not)
WEIGHT_MAX = 1000.0
TENANT_KEY = "tenant."
SEEDED_KEY = "seeded"
PreemptPolicy = Literal["own", "none"]


class TenantRecord(Struct, kw_only=True, forbid_unknown_fields=True):
    """One tenant's quota (None: no limit). Under fair sharing `devices` is its nominal share, guaranteed while it
    wants them, and `borrow` what it may hold beyond it; `weight` is its weight in the weighted max-min over the
    fleet; preempt own lets its higher-priority jobs preempt its own lower ones. Under fifo `devices` caps what its
    running jobs hold. `queued`: its jobs waiting at once; `priority`: the highest its jobs may ask for."""

    weight: float = 1.0
    devices: int | None = None
    borrow: int | None = None
    preempt: PreemptPolicy = "none"
    queued: int | None = QUEUED_DEFAULT
    priority: int | None = 0


def tenant_key(tenant: str) -> str:
    return TENANT_KEY + tenant


def tenant_of_key(key: str) -> str | None:
    """The tenant a key of the bucket holds (None: not a tenant's key)."""
    return key[len(TENANT_KEY) :] if key.startswith(TENANT_KEY) else None


def record_errors(record: TenantRecord) -> list[FieldError]:
    """What is wrong with a tenant's quota, each naming its field and the fix (none: it may be stored)."""
    errors = []
    if not (
        isinstance(record.weight, (int, float)) and math.isfinite(record.weight) and 0 < record.weight <= WEIGHT_MAX
    ):
        errors.append(FieldError("weight", f"give a number above 0, at most {WEIGHT_MAX:g} (default 1)"))
    for name in ("devices", "borrow", "queued"):
        value = getattr(record, name)
        if value is not None and value < 0:
            errors.append(FieldError(name, "give a whole number, 0 or more, or none for no limit"))
    if record.priority is not None and not PRIORITY_MIN <= record.priority <= PRIORITY_MAX:
        errors.append(FieldError("priority", f"give a ceiling from {PRIORITY_MIN} to {PRIORITY_MAX}"))
    if record.preempt not in ("own", "none"):
        errors.append(FieldError("preempt", "give own (its jobs preempt its own lower-priority ones) or none"))
    return errors
