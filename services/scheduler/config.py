"""How a scheduler is tuned: heartbeats, windows, quotas (and the priority a tenant may ask for), history, and the
bounds on its requests."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.co_train import CoTrainPolicy
from schemas.jobs import PRIORITY_MAX, PRIORITY_MIN, StoredRequest
from schemas.validate import FieldError


QUEUED_DEFAULT = 10_000  # a tenant's waiting jobs unless its quota says otherwise: what one tenant can make the
# scheduler hold is bounded (an admin's are not)


@dataclass(frozen=True)
class TenantQuota:
    """What one tenant may hold at once (None: no limit), and the highest priority its jobs may ask for.

    A job's priority orders the tenant's own jobs; against other tenants' jobs it counts only up to the ceiling an
    operator gave the tenant (0 unless given), and against serving engines not at all (see engine_priority)."""

    queued: int | None = QUEUED_DEFAULT  # jobs waiting for a device (each costs the scheduler memory)
    devices: int | None = None  # devices its running jobs hold
    priority: int | None = 0  # the priority ceiling; None: none (an admin's)

    @classmethod
    def parse(cls, text: str) -> "TenantQuota":
        """`queued:10,devices:2,priority:5` (any may be left out; no queued: QUEUED_DEFAULT; no priority: a ceiling
        of 0)."""
        limits = {}
        for part in filter(None, text.split(",")):
            key, _, value = part.partition(":")
            if key == "priority":
                ok = value.removeprefix("-").isdigit() and PRIORITY_MIN <= int(value) <= PRIORITY_MAX
            else:
                ok = key in ("queued", "devices") and value.isdigit()
            if not ok:
                raise ValueError(
                    f"quota {text!r}: write queued:N,devices:M,priority:P (N, M >= 0; P from {PRIORITY_MIN} to "
                    f"{PRIORITY_MAX})"
                )
            limits[key] = int(value)
        return cls(**limits)

    def priority_errors(self, tenant: str | None, priority: int) -> list[FieldError]:
        """A job of `tenant` asking for more than its ceiling is refused, naming the field and the fix."""
        if self.priority is None or priority <= self.priority:
            return []
        return [
            FieldError(
                "priority",
                f"tenant {tenant} may give its jobs a priority of at most {self.priority} (its ceiling); ask for "
                f"{self.priority} or less, or ask an admin to raise the ceiling (--quota {tenant}=priority:P)",
            )
        ]


def engine_priority(stored: StoredRequest) -> int | None:
    """A job's priority against serving engines (--reclaim-pause-priority, an agent's --engine-yield exempt=P):
    an admin's job's own; None for a tenant's, which always gives way to them, whatever priority it asked for."""
    return stored.request.priority if stored.tenant is None else None


@dataclass
class SchedulerConfig:
    heartbeat_interval: float = 1.0
    misses: int = 3
    assign_timeout: float = 2.0
    backfill_window: int = 64
    max_concurrent_submits: int = 256
    idempotency_window_s: float = 24 * 3600.0  # a key sent again within this returns its first job
    finished_in_memory_s: float = 600.0  # a finished job stays in memory this long, then is read from the store
    retention_s: float = 30 * 24 * 3600.0  # a finished job's record and events are removed this long after; 0: never
    retention_artifacts: bool = False  # and its artifacts with them
    sweep_interval_s: float = 60.0  # how often expired records are looked for
    reclaim_pause_priority: int = 0  # jobs at or below this priority pause when their device's engine wants memory
    reconcile_interval_s: float = 30.0  # how often memory is checked against the store's active jobs
    requests_per_tenant: int = 32  # a tenant's requests answered at once (beyond: they wait their turn)
    queued_requests_per_tenant: int = 2048  # a tenant's requests waiting for a turn (beyond: refused as busy)
    queued_request_bytes_per_tenant: int = 256 * 2**20  # and their bytes (submissions carry their data)
    quotas: dict[str, TenantQuota] = field(default_factory=dict)  # per tenant
    default_quota: TenantQuota = TenantQuota()  # for tenants not in quotas
    co_train: CoTrainPolicy = "same-tenant"  # which jobs may share a trainer process (schemas/co_train.py)
    co_train_max: int = 8  # jobs in one co-training group at most

    def quota(self, tenant: str | None) -> TenantQuota:
        """A tenant's own quota, else the default; an admin's (tenant None) has no limit and no ceiling."""
        return (
            TenantQuota(queued=None, priority=None) if tenant is None else self.quotas.get(tenant, self.default_quota)
        )

    @property
    def window(self) -> float:
        return self.heartbeat_interval * self.misses
