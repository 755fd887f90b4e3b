"""What bench/fair_share.py makes of one run: each tenant's device-time against its fair share, how far in-use was
off the shares, how long a tenant below its share took to reach it, utilisation while jobs waited, job completion
and the device-time lost to preemption, from the samples of the scheduler's `tenants` figures taken every SAMPLE_S
and the simulated fleet's counts."""

from __future__ import annotations

import re
import statistics

from bench.fair_share_trace import TENANTS as WEIGHTS
from bench.fleet_bench import pct
from bench.sim_fleet import Fleet

SAMPLE_S = 0.25  # how often the bench samples the tenants' figures
WATCHED = re.compile(
    r"fair share: the longest wait of a tenant below its share for a device while another held more: ([\d.]+) s "
    r"\(tenant (\S+)\); (\d+) past the allowance of [\d.]+ s; the longest below its share: ([\d.]+) s \(tenant (\S+)\)"
)
GC_CPU = re.compile(r"the longest of each generation took ([\d.]+), ([\d.]+), ([\d.]+) ms of CPU")
PASS_CPU = re.compile(r"of CPU: the longest pass ([\d.]+) ms, (\d+) passes past the budget")
WAIT = re.compile(
    r"fair share: tenant (\S+) waited ([\d.]+)s below its share without a device gained \((\d+) of (\d+) devices\)"
    r".*it was given (\d+) devices and let go (\d+), and preemption planned (\d+) for it"
)
OWN = re.compile(r"placement passes without it: the longest ([\d.]+) ms, (\d+) past their budget \((\d+) passes")


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
        sampled_wait=sampled_wait(samples, own_ends_lower_the_mark=True),
        sampled_wait_old=sampled_wait(samples, own_ends_lower_the_mark=False),
    )


def sampled_wait(samples, own_ends_lower_the_mark: bool) -> tuple[float, str]:
    """The invariant's longest wait (services/scheduler/share_watch.py), worked out again from the samples: a tenant
    starved (below its share, its smallest waiting job within what it is owed, another over its share) without a
    gain. own_ends_lower_the_mark: a gain is more than the fewest it held since the wait began (a5da896's rule,
    which took a replaced end for a gain); else more than it held when the wait began (the scheduler's rule without
    the preemptions it planned, which the samples do not show: a 1 s job's end, replaced, is no gain)."""
    longest, since, mark = (0.0, "-"), {}, {}
    for t, rows in samples:
        over = {name for name, r in rows.items() if r.in_use > r.fair_share}
        for name, r in rows.items():
            starved = r.smallest_wanted is not None and r.in_use + r.smallest_wanted <= r.fair_share and over - {name}
            if starved and name in since and r.in_use <= mark[name]:
                mark[name] = min(mark[name], r.in_use) if own_ends_lower_the_mark else mark[name]
                continue
            if name in since:
                longest = max(longest, (t - since.pop(name), name))
            if starved:
                since[name], mark[name] = t, r.in_use
    return longest


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


def from_log(text: str, bound: float) -> dict:
    """What the scheduler's log says: preemptions, the collector's and the passes' CPU, the share watch's longest
    wait and each wait past `bound` with what it held (devices given, let go, planned for it)."""
    out: dict = {}
    if m := re.search(r"preemptions: (.*)", text):
        out["preempt_log"] = m[1]
    if m := GC_CPU.search(text):
        out.update(gc_young_cpu_ms=max(float(m[2]), float(m[3])))
    if m := PASS_CPU.search(text):
        out.update(pass_cpu_ms=float(m[1]), cpu_cut_short=int(m[2]))
    if m := OWN.search(text):
        out.update(own_pass_ms=float(m[1]), own_cut_short=int(m[2]), gc_in_pass=int(m[3]))
    if m := WATCHED.search(text):
        out.update(longest_wait_s=float(m[1]), longest_wait_of=m[2], past_allowance=int(m[3]))
        out.update(longest_below_s=float(m[4]), longest_below_of=m[5])
    out["waits_past"] = [w.groups() for w in WAIT.finditer(text) if float(w[2]) > bound]
    return out
