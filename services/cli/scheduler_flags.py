"""`jetlora scheduler`'s flags (and `up`'s, which runs one), and the SchedulerConfig built from them (a flag's
mistake is a StartupError)."""

from __future__ import annotations

import argparse

from schemas.co_train import CO_TRAIN_POLICIES
from services.runtime import StartupError

QUOTA = "queued:N,devices:M,priority:P,weight:W,borrow:B,preempt:own"


def scheduler_config(args):
    from services.scheduler.config import WEIGHT_MAX, SchedulerConfig, TenantQuota

    try:
        quotas = {tenant: TenantQuota.parse(limits) for tenant, _, limits in (q.partition("=") for q in args.quota)}
        default = TenantQuota.parse(args.default_quota)
    except ValueError as e:
        raise StartupError(f"--quota/--default-quota: {e}") from None
    if args.co_train_max < 1:
        raise StartupError(f"--co-train-max {args.co_train_max}: a group holds at least 1 job; give 1 or more")
    if not 0 < args.admin_weight <= WEIGHT_MAX:
        raise StartupError(f"--admin-weight {args.admin_weight}: give a number above 0, at most {WEIGHT_MAX:g}")
    for flag, value in (("--min-run-s", args.min_run_s), ("--preempt-backoff-s", args.preempt_backoff_s)):
        if not value >= 0:
            raise StartupError(f"{flag} {value}: give seconds, 0 or more")
    return SchedulerConfig(
        heartbeat_interval=args.heartbeat_interval,
        misses=args.misses,
        quotas=quotas,
        default_quota=default,
        reclaim_pause_priority=args.reclaim_pause_priority,
        retention_s=args.retention_days * 86400,
        retention_artifacts=args.retention_artifacts,
        finished_in_memory_s=args.finished_in_memory_s,
        idempotency_window_s=args.idempotency_hours * 3600,
        reconcile_interval_s=args.reconcile_interval_s,
        requests_per_tenant=args.requests_per_tenant,
        co_train=args.co_train,
        co_train_max=args.co_train_max,
        sharing=args.sharing,
        admin_class=args.admin_class,
        admin_weight=args.admin_weight,
        min_run_s=args.min_run_s,
        preempt_backoff_s=args.preempt_backoff_s,
    )


def scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--misses", type=int, default=3, help="heartbeats missed before a node counts as gone")
    p.add_argument(
        "--quota",
        action="append",
        default=[],
        metavar=f"TENANT={QUOTA}",
        help="one tenant's limits (repeat for each tenant): its waiting jobs; its devices (fair sharing: the nominal "
        "devices guaranteed while it wants them; fifo: a cap); its weight in the fair share (default 1); the devices "
        "it may borrow beyond nominal (default: no limit); preempt:own lets its jobs preempt its own lower-priority "
        "ones; and the highest priority its jobs may ask for (default 0)",
    )
    p.add_argument(
        "--default-quota",
        default="",
        metavar=QUOTA,
        help="the quota of tenants without their own --quota (default: 10,000 queued jobs, weight 1, no nominal "
        "devices, no borrowing limit, priority ceiling 0)",
    )
    _sharing_flags(p)
    _co_train_flags(p)
    p.add_argument(
        "--reclaim-pause-priority",
        type=int,
        default=0,
        help="admins' jobs at or below this priority pause when their GPU's serving engine wants memory back "
        "(a tenant's always do)",
    )
    p.add_argument(
        "--retention-days",
        type=float,
        default=30.0,
        help="finished jobs' records and events are removed this long after they end (0: kept forever)",
    )
    p.add_argument("--retention-artifacts", action="store_true", help="and their artifacts with them")
    p.add_argument(
        "--finished-in-memory-s",
        type=float,
        default=600.0,
        help="a finished job stays in the scheduler's memory this long; then it is read from the store",
    )
    p.add_argument(
        "--reconcile-interval-s",
        type=float,
        default=30.0,
        help="how often the scheduler compares what it holds in memory with the store's active jobs",
    )
    p.add_argument(
        "--requests-per-tenant",
        type=int,
        default=32,
        help="a tenant's requests the scheduler answers at once; more wait their turn (a few hundred more are "
        "refused as busy)",
    )
    p.add_argument(
        "--idempotency-hours",
        type=float,
        default=24.0,
        help="a submission's idempotency key returns its first job for this long",
    )


def _sharing_flags(p: argparse.ArgumentParser) -> None:
    """How tenants share the fleet: fair shares with borrowing and preemption, or priority then age."""
    p.add_argument(
        "--sharing",
        choices=("fair", "fifo"),
        default="fair",
        help="fair: each tenant's weighted max-min share of the devices, its nominal ones guaranteed, idle devices "
        "lent and taken back by preempting with a checkpoint; fifo: priority then age across tenants, devices:N a cap",
    )
    p.add_argument(
        "--admin-class",
        choices=("above", "among"),
        default="above",
        help="admins' jobs (fair sharing): placed before every tenant's and never preempted by them (above), or "
        "shared as one more tenant of --admin-weight (among)",
    )
    p.add_argument("--admin-weight", type=float, default=1.0, help="admins' weight with --admin-class among")
    p.add_argument(
        "--min-run-s",
        type=float,
        default=120.0,
        metavar="S",
        help="a job runs at least this long before it may be preempted",
    )
    p.add_argument(
        "--preempt-backoff-s",
        type=float,
        default=600.0,
        metavar="S",
        help="a job preempted is not preempted again within this",
    )


def _co_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--co-train",
        choices=CO_TRAIN_POLICIES,
        default="same-tenant",
        help="which queued jobs of one base model may train in one process on a device, sharing the base: off "
        "(none), same-tenant (a tenant's own jobs: tenants' data never share a process), any",
    )
    p.add_argument(
        "--co-train-max", type=int, default=8, help="jobs in one co-training group at most (the scheduler's --co-train)"
    )
