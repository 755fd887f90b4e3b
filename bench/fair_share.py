"""Sharing a busy fleet among tenants: the real scheduler (its own process) on an embedded nats-server, a simulated
fleet (bench/sim_fleet.py: 1,000 agents x 8 GPUs heartbeating on the real subjects, honouring stop-and-save: a
paused job checkpoints at its step and a resumed one goes on from it) and three tenants submitting from a trace of
a recorded shape (bench/fair_share_trace.py): acme's burst of long jobs larger than the fleet, then a second;
globex's bursts of medium jobs; initech (weight 2) a small burst of short jobs every few seconds; each burst's jobs
of every shape a shared fleet sees: on one device, on two, on a whole node of eight, pinned to a node, co-training
in a group of their tenant's, at priorities -1 to 2. The same seeded trace runs under --sharing fifo (priority then
age; --fifo-cap: each tenant's devices:N cap, none by default) and --sharing fair (weights 1:1:2, preemption by
checkpoint), sides alternating (ABBA), a fresh store each; co-training same-tenant on both.

Printed per side (median of the rounds, then their range):
- each tenant's share of the device-time against its fair share (the scheduler's `tenants` figures, sampled every
  SAMPLE_S), and the largest deviation of in-use from fair share (a fraction of the fleet), at any sample and on
  average;
- the time a tenant that starts waiting below its share takes to reach it (held >= share less 1%, or nothing it
  waits with would fit in what it is still owed, or as many devices idle as it is owed: then what it waits for, a
  node its job is pinned to, a whole node for a gang, is no other tenant's to give back): p50 / p99 over every
  burst of every tenant; and the same counting those waits too;
- the fair-share invariant, which the scheduler checks at every preemption check (services/scheduler/
  share_watch.py): a tenant is starved while it holds less than its share, a waiting job of it asks for no more than
  it is owed, and another tenant holds more than its share; its wait runs while it stays starved and the scheduler does nothing
  for it: it begins afresh when the tenant holds more than the most it held in the wait, or when preemption plans
  devices for it (its own short jobs ended and replaced one for one are no progress: preemption must act within the
  bound); no wait may pass --min-run-s + the
  settle time (--settle-s). Each wait past it is printed with what happened in it: the devices the tenant was given
  and let go, and those preemption planned for it (none: the scheduler found nothing to take). Beside it, the
  longest a tenant stayed below its share at all, gaining devices or not;
- fleet utilisation while jobs wait (devices in use over the fleet, at samples where demand exceeds the fleet);
- job completion time (submission to success): mean and p99;
- the device-time lost to preemption (checkpoint saves and loads, work redone) against the device-time worked;
- the scheduler's placement passes: the most CPU time one took (its own work, what the budget promises) and the
  longest by wall time (which counts the process waiting for a core); the collector's pauses; late lease renewals,
  and the faults that must not happen;
- the simulated fleet, in a process of its own (bench/fair_share_fleet.py; --fleet same: in the bench's loop, as
  before): how late its loop ran, and how long a pause took to land (asked to paused);
- where the jobs that did not finish in the run stand, if any.
It exits non-zero when a promise it prints breaks: the invariant, no Deposed leader, no submission refused, and the
targets (fair: a tenant below its share reaches it in p99 <= 10 s; utilisation while jobs wait within 2% of fifo's;
device-time lost to preemption < 1%; every placement pass's CPU time within its 10 ms budget).
Run by hand:  python bench/fair_share.py [--nodes 1000 --rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from bench.fair_share_figures import SAMPLE_S, from_log, measure  # noqa: E402
from bench.fair_share_fleet import LAG_S, fleet_stack, leftovers, ticker  # noqa: E402
from bench.fair_share_trace import TENANTS as WEIGHTS, mix, trace  # noqa: E402
from bench.fleet_bench import sim_stack  # noqa: E402
from bench.guarantees import Guarantees  # noqa: E402
from schemas import names  # noqa: E402
from schemas.jobs import Accepted, SubmitReply  # noqa: E402
from schemas.tenants import TenantList, TenantsQuery  # noqa: E402
from services import bus  # noqa: E402

SCHED_LOG = "/tmp/jetlora-bench-fair-share-{side}.log"
REACH_P99_S, UTILISATION_GAP, LOST_MAX, PASS_BUDGET_MS = 10.0, 0.02, 0.01, 10.0  # the targets
enc = msgspec.json.Encoder()
dec_reply = msgspec.json.Decoder(SubmitReply)


def scheduler_flags(args, side: str) -> list[str]:
    flags = [
        "--heartbeat-interval",
        str(args.interval),
        "--misses",
        "3",
        "--sharing",
        side,
        "--co-train",
        "same-tenant",
    ]
    flags += ["--min-run-s", str(args.min_run_s), "--preempt-backoff-s", str(args.backoff_s)]
    for tenant, weight in WEIGHTS.items():
        cap = f",devices:{int(args.nodes * args.gpus * args.fifo_cap)}" if side == "fifo" and args.fifo_cap else ""
        flags += ["--quota", f"{tenant}=weight:{weight},priority:2{cap}"]
    return flags


async def run_once(args, side: str) -> dict:
    """One whole run of the trace against a fresh store: the figures of one side. The simulated fleet runs in a
    process of its own (bench/fair_share_fleet.py; --fleet same: in the bench's loop, as before)."""
    log = SCHED_LOG.format(side=side)
    if args.fleet == "same":
        stack = sim_stack(scheduler_flags(args, side), log, args.nodes, args.gpus, interval=args.interval)
    else:
        stack = fleet_stack(scheduler_flags(args, side), log, args.nodes, args.gpus, args.interval)
    async with stack as s:
        fleet = s.fleet if args.fleet != "same" else SameLoop(s.fleet)
        out = await drive(args, s.client, fleet)
    out |= s.figures()  # passes, longest_pass_ms, cut_short, renewals_late, deposed, gc_full, gc_full_ms, ...
    return out | from_log(Path(log).read_text(), args.min_run_s + args.settle_s)


class SameLoop:
    """The fleet in the bench's own loop (--fleet same), asked as bench/fair_share_fleet.py's process is."""

    def __init__(self, fleet) -> None:
        self.fleet = fleet

    async def done(self) -> int:
        return len(self.fleet.done_at)

    async def final(self):
        return self.fleet


async def drive(args, client, fleet) -> dict:
    """Submit the trace on its schedule, sample the shares until every job ended (or --limit-s), and measure."""
    bursts = trace(args.nodes, args.gpus, args.seed)
    submitted: dict[str, tuple[str, float]] = {}  # job -> (tenant, when submitted)
    samples: list[tuple[float, dict]] = []
    rejected: list[str] = []
    sem = asyncio.Semaphore(args.concurrency)
    t0 = time.monotonic()

    async def submit(tenant: str, shape) -> None:
        async with sem:
            at = time.monotonic()
            msg = await client.request(names.jobs_api(tenant).submit, enc.encode(shape.request()), timeout=30)
        reply = dec_reply.decode(msg.data)
        if isinstance(reply, Accepted):
            submitted[reply.job] = (tenant, at)
        else:
            rejected.append(str(reply))

    async def play(when: float, tenant: str, shapes: list) -> None:
        await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
        await asyncio.gather(*(submit(tenant, shape) for shape in shapes))

    async def sample() -> None:
        while True:
            try:
                reply = await bus.request(client, names.TENANTS, TenantsQuery(), TenantList, timeout=5)
                samples.append((time.monotonic() - t0, {t.tenant: t for t in reply.tenants}))
            except bus.RequestError:
                pass
            await asyncio.sleep(SAMPLE_S)

    sampler = asyncio.create_task(sample())
    lags: list[float] = []
    stop_ticking = asyncio.Event()
    ticking = asyncio.create_task(ticker(lags, stop_ticking))
    await asyncio.gather(*(play(*b) for b in bursts))
    total = sum(len(w) for _, _, w in bursts)
    deadline = t0 + args.limit_s
    while time.monotonic() < deadline and await fleet.done() < len(submitted):
        await asyncio.sleep(0.5)
    sampler.cancel()
    ticking.cancel()
    ran = await fleet.final()  # what the fleet did: jobs' ends, device-time worked and lost, pauses
    if args.dump:  # the samples, for a look at how each tenant's share and holding moved
        with open(args.dump, "a") as f:
            for at, rows in samples:
                f.write(msgspec.json.encode({"t": round(at, 2), "rows": list(rows.values())}).decode() + "\n")
    left = await leftovers(client, [j for j in submitted if j not in ran.done_at], ran)
    fleet_figures = {k: getattr(ran, k, None) for k in ("loop_lag_max_s", "loop_held_s", "pause_p50_s", "pause_p99_s")}
    return (
        measure(args, bursts, submitted, samples, ran, t0)
        | {k: v for k, v in fleet_figures.items() if v is not None}
        | dict(bench_lag_max_s=max(lags, default=0.0), bench_held_s=sum(x for x in lags if x > LAG_S))
        | left
        | dict(
            jobs=total, accepted=len(submitted), rejected=len(rejected), first_rejection=rejected[0] if rejected else ""
        )
    )


def report(args, results: dict[str, list[dict]], promises: Guarantees) -> None:
    def fig(side, key, fmt=lambda v: f"{v:.2f}") -> str:
        values = [r[key] for r in results[side] if key in r and r[key] == r[key]]
        if not values:
            return "-"
        return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"

    percent = lambda v: f"{v:.1%}"  # noqa: E731
    count = lambda v: f"{v:.0f}"  # noqa: E731
    print(f"\n{args.nodes} agents x {args.gpus} GPUs; tenants {WEIGHTS} (weights); trace seed {args.seed}")
    print(f"the trace: {mix(trace(args.nodes, args.gpus, args.seed))}")
    for side, runs in results.items():
        cap = f", devices:{args.fifo_cap:.0%} of the fleet each" if side == "fifo" and args.fifo_cap else ""
        print(f"\n--sharing {side}{cap} ({len(runs)} runs; median (range))")
        for t in WEIGHTS:
            got, fair = fig(side, f"share_{t}", percent), fig(side, f"fair_{t}", percent)
            print(f"  {t}: device-time {got} against a fair share of {fair}")
        print(
            f"  in use against fair share, largest gap: {fig(side, 'deviation_max', percent)} of the fleet (as a burst "
            f"lands); mean over the run {fig(side, 'deviation_mean', percent)}"
        )
        print(
            f"  a tenant waiting below its share reached it in p50 {fig(side, 'reach_p50')} s, p99 "
            f"{fig(side, 'reach_p99')} s; bursts that never did: {fig(side, 'reach_missed', count)} (counting the waits "
            f"for what no tenant holds, a pinned node or a whole node, too: p50 {fig(side, 'placed_p50')} s, p99 "
            f"{fig(side, 'placed_p99')} s)"
        )
        print(f"  utilisation while jobs wait: {fig(side, 'utilisation', percent)}")
        print(
            f"  job completion: mean {fig(side, 'jct_mean')} s, p99 {fig(side, 'jct_p99')} s "
            f"({fig(side, 'finished', count)} of {fig(side, 'accepted', count)} jobs; all done in {fig(side, 'makespan')} s)"
        )
        lost = fig(side, "lost", lambda v: f"{v:.2%}")
        print(
            f"  device-time lost to preemption: {lost} of the device-time worked ({fig(side, 'preempted', count)} pauses)"
        )
        print(
            f"  placement passes: longest {fig(side, 'longest_pass_ms', lambda v: f'{v:.1f}')} ms, past their budget "
            f"{fig(side, 'cut_short', count)}; late lease renewals {fig(side, 'renewals_late', count)}"
        )
        print(
            f"  garbage collection while leading: {fig(side, 'gc_full', count)} full, the longest "
            f"{fig(side, 'gc_full_ms', lambda v: f'{v:.1f}')} ms; younger ones the longest "
            f"{fig(side, 'gc_young_ms', lambda v: f'{v:.1f}')} ms (of CPU {fig(side, 'gc_young_cpu_ms', lambda v: f'{v:.1f}')} "
            f"ms); passes without its pauses: longest "
            f"{fig(side, 'own_pass_ms', lambda v: f'{v:.1f}')} ms, past their budget {fig(side, 'own_cut_short', count)} "
            f"({fig(side, 'gc_in_pass', count)} passes a collection landed in); the longest pass's CPU "
            f"{fig(side, 'pass_cpu_ms', lambda v: f'{v:.1f}')} ms, passes past the budget on CPU alone "
            f"{fig(side, 'cpu_cut_short', count)}"
        )
        ms = lambda v: f"{v * 1000:.0f}"  # noqa: E731
        print(
            f"  the simulated fleet ({args.fleet} loop): its loop late by up to {fig(side, 'loop_lag_max_s', ms)} ms "
            f"(held past {LAG_S * 1000:.0f} ms for {fig(side, 'loop_held_s')} s in all); a pause asked to paused in "
            f"p50 {fig(side, 'pause_p50_s')} s, p99 {fig(side, 'pause_p99_s')} s; the bench's loop late by up to "
            f"{fig(side, 'bench_lag_max_s', ms)} ms ({fig(side, 'bench_held_s')} s in all)"
        )
        for r in runs:
            print(f"  the slowest bursts to their share: {r['reach_slowest']}")
            if r.get("unfinished"):
                print(f"  not finished in the run: {r['unfinished']}: {r['left_states']}")
                for state, example in r["left_examples"].items():
                    print(f"    {state}: {example}")
            if r.get("first_rejection"):
                print(f"  first refusal: {r['first_rejection'][:300]}")
        faults = {k: sum(r.get(k, 0) for r in runs) for k in ("deposed", "rejected")}
        promises.check(faults["deposed"] == 0, f"{side}: no leader deposed (saw {faults['deposed']})")
        promises.check(faults["rejected"] == 0, f"{side}: no submission refused (saw {faults['rejected']})")
        cpu = max((r.get("pass_cpu_ms", float("inf")) for r in runs), default=float("inf"))
        over = sum(r.get("cpu_cut_short", 1) for r in runs)
        promises.check(
            cpu <= PASS_BUDGET_MS and over == 0,
            f"{side}: every placement pass's own work (its CPU time) within its {PASS_BUDGET_MS:g} ms budget "
            f"(the most {cpu:.1f} ms; {over} past; by wall time, which counts waiting for a core, the longest "
            f"{max(r.get('longest_pass_ms', 0.0) for r in runs):.1f} ms)",
        )
        if side == "fair":
            fair_promises(args, runs, promises)
    if set(results) == {"fifo", "fair"}:
        u = {s: statistics.median(r["utilisation"] for r in results[s]) for s in results}
        ratio = u["fair"] / u["fifo"]
        print(f"\nutilisation fair / fifo: {ratio:.3f}")
        promises.check(
            ratio >= 1 - UTILISATION_GAP,
            f"utilisation while jobs wait within {UTILISATION_GAP:.0%} of fifo's ({ratio:.3f}x)",
        )


def fair_promises(args, runs: list[dict], promises: Guarantees) -> None:
    """The fair-share invariant (watched by the scheduler at every check) and the targets, for each run."""
    bound = args.min_run_s + args.settle_s
    for r in runs:
        longest = r.get("longest_wait_s")
        print(
            f"  invariant: the longest wait of a tenant below its share (with a job it is owed) for a device while "
            f"another held more: {'-' if longest is None else f'{longest:.1f}'} s (tenant {r.get('longest_wait_of')}); "
            f"bound {bound:g} s (--min-run-s {args.min_run_s:g} + --settle-s {args.settle_s:g}); below its share at "
            f"all, gaining or not: {r.get('longest_below_s', '-')} s (tenant {r.get('longest_below_of')}); from the "
            f"samples, a gain past the most it held (no preemption seen there): {r['sampled_wait_old'][0]:.1f} s "
            f"({r['sampled_wait_old'][1]}), past the fewest (the rule of a5da896, which a review showed passed a "
            f"scheduler that never preempted): {r['sampled_wait'][0]:.1f} s ({r['sampled_wait'][1]})"
        )
        for tenant, took, held, share, given, let_go, planned in r.get("waits_past", []):
            print(
                f"    a wait past the bound: {tenant} {took} s at {held} of {share} devices; in it given {given}, let "
                f"go {let_go} of its own, preemption planned {planned} for it"
            )
        promises.check(
            longest is not None and longest <= bound,
            f"fair: no tenant below its share waits past {bound:g} s for a device while another is over its share "
            f"({longest} s)",
        )
        promises.check(
            r["reach_p99"] <= REACH_P99_S and not r["reach_missed"],
            f"fair: a tenant below its share reaches it in p99 <= {REACH_P99_S:g} s ({r['reach_p99']:.2f} s, "
            f"{r['reach_missed']} bursts never did)",
        )
        promises.check(r["lost"] < LOST_MAX, f"fair: device-time lost to preemption < {LOST_MAX:.0%} ({r['lost']:.2%})")


async def main(args) -> int:
    sides = [s for s in args.sides.split(",") if s]
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            print(f"round {r + 1}: --sharing {side} ...", flush=True)
            results[side].append(await run_once(args, side))
    promises = Guarantees()
    report(args, results, promises)
    return promises.verdict()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--min-run-s", type=float, default=5.0, help="the scheduler's (the trace's time is compressed)")
    ap.add_argument("--backoff-s", type=float, default=20.0, help="the scheduler's --preempt-backoff-s")
    ap.add_argument(
        "--settle-s",
        type=float,
        default=3.0,
        help="the invariant's allowance beyond --min-run-s for a preemption to land (a pause, its checkpoint, the "
        "device seen free: the scheduler's heartbeat window, 3 x --interval)",
    )
    ap.add_argument(
        "--fifo-cap", type=float, default=0.0, help="fifo: each tenant's devices cap, a fraction of the fleet (0: none)"
    )
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--limit-s", type=float, default=240.0, help="a run ends here even if jobs are left")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each side (sides alternate: ABBA...)")
    ap.add_argument("--sides", default="fifo,fair")
    ap.add_argument(
        "--fleet",
        choices=("own", "same"),
        default="own",
        help="the simulated fleet in a process of its own, or "
        "in the bench's loop beside the submitters and the sampler (as before)",
    )
    ap.add_argument("--dump", default="", help="append each sample of the tenants' figures to this file (JSON lines)")
    sys.exit(asyncio.run(main(ap.parse_args())))
