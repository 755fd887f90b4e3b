"""What bench/fair_share.py makes of one run: each tenant's device-time against its fair share, how far in-use was
off the shares, how long a tenant below its share took to reach it, utilisation while jobs waited, job completion
and the device-time lost to preemption, from the samples of the scheduler's `tenants` figures taken every SAMPLE_S
and the simulated fleet's counts."""

from __future__ import annotations

import statistics

from bench.fair_share_trace import TENANTS as WEIGHTS
from bench.fleet_bench import pct
from bench.sim_fleet import Fleet

SAMPLE_S = 0.25  # how often the bench samples the tenants' figures


def measure(args, bursts, submitted, samples, fleet: Fleet, t0: float) -> dict:
    devices = args.nodes * args.gpus
    used = {t: 0.0 for t in WEIGHTS}
    fair = {t: 0.0 for t in WEIGHTS}
    deviations, busy = [], []
    for _, rows in samples:
        for t in WEIGHTS:
            row = rows.get(t)
            used[t] += row.in_use if row else 0
            fair[t] += row.fair_share if row else 0
        deviations.append(max((abs(r.in_use - r.fair_share) for r in rows.values()), default=0) / devices)
        if sum(r.in_use + r.wanted for r in rows.values()) > devices:  # jobs wait: every device should work
            busy.append(sum(r.in_use for r in rows.values()) / devices)  # (a co-training group's device once)
    reached = [(r, b[1], b[0]) for b in bursts if (r := time_to_share(b, samples, devices)) is not None]
    reach = [r for r, _, _ in reached]
    missed = sum(1 for b in bursts if time_to_share(b, samples, devices) is None)
    placed = [r for b in bursts if (r := time_to_share(b, samples, devices, placed_all=True)) is not None]
    slowest = ", ".join(f"{t} at {at:g} s: {r:.1f} s" for r, t, at in sorted(reached, reverse=True)[:3])
    done = [fleet.done_at[j] - at for j, (_, at) in submitted.items() if j in fleet.done_at]
    whole = sum(used.values()) or 1.0
    out = {f"share_{t}": used[t] / whole for t in WEIGHTS} | {f"fair_{t}": fair[t] / whole for t in WEIGHTS}
    return out | dict(
        deviation_max=max(deviations, default=0.0),
        deviation_mean=statistics.fmean(deviations) if deviations else 0.0,
        reach_p50=pct(reach, 50),
        reach_p99=pct(reach, 99),
        reach_missed=missed,
        reach_slowest=slowest,
        placed_p50=pct(placed, 50),
        placed_p99=pct(placed, 99),
        utilisation=statistics.fmean(busy) if busy else float("nan"),
        jct_mean=statistics.fmean(done) if done else float("nan"),
        jct_p99=pct(done, 99),
        finished=len(done),
        lost=fleet.lost_s / max(fleet.work_s + fleet.lost_s, 1e-9),
        preempted=sum(fleet.paused.values()),
        makespan=max(fleet.done_at.values(), default=t0) - t0,
    )


def time_to_share(burst, samples, devices: int, placed_all: bool = False) -> float | None:
    """Seconds from a burst until its tenant held its fair share (less 1%), if it was below it; 0: it never was;
    None: it never got there in the run. Reached too when nothing it waits with fits in what it is still owed, or
    when the fleet has that many devices idle: what it waits for then is no other tenant's to give back (a node its
    jobs are pinned to, a whole node for a gang), which sharing does not promise. placed_all: only when every job it
    waits with could be placed (the old measure, which counts such waits too)."""
    when, tenant, _ = burst
    below = False
    for t, rows in samples:
        row = rows.get(tenant)
        if t < when + SAMPLE_S or row is None:
            continue
        owed = row.fair_share - row.in_use
        idle = devices - sum(r.in_use for r in rows.values())
        if owed <= max(1, row.fair_share // 100) or not row.queued or (row.smallest_wanted or 0) > owed:
            return t - when if below else 0.0  # at its share, or nothing it waits with fits in what it is owed
        if not placed_all and idle >= owed:
            return t - when if below else 0.0
        below = True
    return None
