"""How a scheduler is tuned: heartbeats, windows, quotas (and the priority a tenant may ask for), how tenants share
the fleet, history, and the bounds on its requests."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from schemas.co_train import CoTrainPolicy
from schemas.jobs import PRIORITY_MAX, PRIORITY_MIN
from schemas.job_status import StoredRequest
from schemas.tenants import QUEUED_DEFAULT, WEIGHT_MAX, AdminClass, Sharing, TenantRecord, record_errors
from schemas.validate import FieldError

__all__ = ["QUEUED_DEFAULT", "WEIGHT_MAX", "SchedulerConfig", "TenantQuota"]
QUOTA_FORM = "queued:N,devices:M,priority:P,weight:W,borrow:B,preempt:own"


@dataclass(frozen=True)
class TenantQuota:
    """What one tenant may hold at once (None: no limit), its weight in the fleet's sharing, and the highest
    priority its jobs may ask for: a tenant's record in the tenants bucket (schemas/tenants.TenantRecord), as the
    scheduler applies it.

    Under --sharing fifo, `devices` caps the devices its running jobs hold. Under fair (the default) `devices` is
    its nominal share, guaranteed while it wants them, and `borrow` what it may hold beyond it (None: as many as
    nobody else waits for); `weight` is its weight in the weighted max-min over the fleet, and `preempt_own` lets
    its higher-priority jobs preempt its own lower ones. A job's priority orders the tenant's own jobs; against
    other tenants' jobs it counts only up to the ceiling an operator gave the tenant (0 unless given), and against
    serving engines not at all (see engine_priority)."""

    queued: int | None = QUEUED_DEFAULT  # jobs waiting for a device (each costs the scheduler memory)
    devices: int | None = None  # devices its running jobs hold: a cap (fifo), its nominal share (fair)
    priority: int | None = 0  # the priority ceiling; None: none (an admin's)
    weight: float = 1.0  # its weight in the fair share (fair sharing)
    borrow: int | None = None  # devices it may hold beyond `devices` (fair sharing); None: no limit
    preempt_own: bool = False  # its jobs preempt its own lower-priority ones (fair sharing)

    @classmethod
    def parse(cls, text: str) -> "TenantQuota":
        """`queued:10,devices:2,priority:5,weight:2,borrow:4,preempt:own` (any may be left out; no queued:
        QUEUED_DEFAULT; no priority: a ceiling of 0; no weight: 1; no borrow: no limit)."""
        limits: dict = {}
        for part in filter(None, text.split(",")):
            key, _, value = part.partition(":")
            ok = key in ("queued", "devices", "borrow", "priority", "weight", "preempt")
            if key == "weight":
                ok = _number(value) is not None
                limits[key] = _number(value)
            elif key == "preempt":
                limits[key] = value
            elif ok:
                ok = value.removeprefix("-").isdigit()
                limits[key] = int(value) if ok else value
            if not ok:
                raise ValueError(_form_error(text))
        try:
            record = TenantRecord(**limits)
        except TypeError:
            raise ValueError(_form_error(text)) from None
        if record_errors(record):
            raise ValueError(_form_error(text))
        return cls.of(record)

    @classmethod
    def of(cls, record: TenantRecord) -> "TenantQuota":
        """The quota a stored record gives (checked with schemas.tenants.record_errors first)."""
        return cls(
            queued=record.queued,
            devices=record.devices,
            priority=record.priority,
            weight=float(record.weight),
            borrow=record.borrow,
            preempt_own=record.preempt == "own",
        )

    def record(self) -> TenantRecord:
        """The quota as the tenants bucket stores it."""
        return TenantRecord(
            weight=self.weight,
            devices=self.devices,
            borrow=self.borrow,
            preempt="own" if self.preempt_own else "none",
            queued=self.queued,
            priority=self.priority,
        )

    @property
    def nominal(self) -> int:
        """Devices guaranteed under fair sharing."""
        return self.devices or 0

    def cap(self, sharing: str) -> int | None:
        """The most devices the tenant's jobs may hold: `devices` under fifo; nominal + borrow under fair."""
        if sharing == "fifo":
            return self.devices
        return None if self.borrow is None else self.nominal + self.borrow

    def priority_errors(self, tenant: str | None, priority: int) -> list[FieldError]:
        """A job of `tenant` asking for more than its ceiling is refused, naming the field and the fix."""
        if self.priority is None or priority <= self.priority:
            return []
        return [
            FieldError(
                "priority",
                f"tenant {tenant} may give its jobs a priority of at most {self.priority} (its ceiling); ask for "
                f"{self.priority} or less, or ask an admin to raise the ceiling (`jetlora tenants set {tenant} --priority P`)",
            )
        ]


@functools.lru_cache(maxsize=16)
def _admin_quota(weight: float) -> TenantQuota:
    """An admin's quota (no limit, no ceiling), made once per weight: asked at every placement try."""
    return TenantQuota(queued=None, priority=None, weight=weight)


def _form_error(text: str) -> str:
    return (
        f"quota {text!r}: write {QUOTA_FORM} (N, M, B >= 0; P from {PRIORITY_MIN} to {PRIORITY_MAX}; W a number above "
        f"0, at most {WEIGHT_MAX:g}; preempt own or none)"
    )


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value and value not in (float("inf"), float("-inf")) else None


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
    sharing: Sharing = "fair"  # fair: weighted max-min shares with borrowing and preemption; fifo: priority then age
    admin_class: AdminClass = "above"  # admins' jobs: placed before tenants' (never preempted by them), or among them
    admin_weight: float = 1.0  # admins' weight when they are among the tenants
    min_run_s: float = 120.0  # a job runs at least this long before it may be preempted
    preempt_backoff_s: float = 600.0  # a job preempted is not preempted again within this

    def quota(self, tenant: str | None) -> TenantQuota:
        """A tenant's own quota, else the default; an admin's (tenant None) has no limit and no ceiling (and, among
        the tenants, --admin-weight)."""
        if tenant is None:
            return _admin_quota(self.admin_weight)
        return self.quotas.get(tenant, self.default_quota)

    def cap(self, tenant: str | None) -> int | None:
        """The most devices the tenant's running jobs may hold (None: no limit)."""
        return self.quota(tenant).cap(self.sharing)

    @property
    def admins_above(self) -> bool:
        """Admins' jobs are placed before any tenant's and never preempted by them (fair sharing, --admin-class
        above); under fifo they take their turn by priority and age, as everyone's."""
        return self.sharing == "fair" and self.admin_class == "above"

    @property
    def window(self) -> float:
        return self.heartbeat_interval * self.misses
