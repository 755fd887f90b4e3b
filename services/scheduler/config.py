"""How a scheduler is tuned: heartbeats, windows, quotas, history, and the bounds on its requests."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TenantQuota:
    """What one tenant may hold at once; None: no limit."""

    queued: int | None = None  # jobs waiting for a device
    devices: int | None = None  # devices its running jobs hold

    @classmethod
    def parse(cls, text: str) -> "TenantQuota":
        """`queued:10,devices:2` (either may be left out)."""
        limits = {}
        for part in filter(None, text.split(",")):
            key, _, value = part.partition(":")
            if key not in ("queued", "devices") or not value.isdigit():
                raise ValueError(f"quota {text!r}: write queued:N,devices:M")
            limits[key] = int(value)
        return cls(**limits)


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
    queued_requests_per_tenant: int = 512  # a tenant's requests waiting for a turn (beyond: refused as busy)
    quotas: dict[str, TenantQuota] = field(default_factory=dict)  # per tenant
    default_quota: TenantQuota = TenantQuota()  # for tenants not in quotas

    def quota(self, tenant: str | None) -> TenantQuota:
        return TenantQuota() if tenant is None else self.quotas.get(tenant, self.default_quota)

    @property
    def window(self) -> float:
        return self.heartbeat_interval * self.misses
