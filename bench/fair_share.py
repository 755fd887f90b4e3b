"""Sharing a busy fleet among tenants: the real scheduler (its own process) on an embedded nats-server, a simulated
fleet (bench/sim_fleet.py: 1,000 agents x 8 GPUs heartbeating on the real subjects, honouring stop-and-save: a
paused job checkpoints at its step and a resumed one goes on from it) and three tenants submitting from a trace of
a recorded shape: acme's burst of long jobs larger than the fleet, then a second; globex's bursts of medium jobs;
initech (weight 2) a small burst of short jobs every few seconds. The same seeded trace runs under --sharing fifo
(priority then age; --fifo-cap: each tenant's devices:N cap, none by default) and --sharing fair (weights 1:1:2,
preemption by checkpoint), sides alternating (ABBA), a fresh store each. Co-training is off: shares are devices.

Printed per side (median of the rounds, then their range):
- each tenant's share of the device-time against its fair share (the scheduler's `tenants` figures, sampled every
  SAMPLE_S), and the largest deviation of in-use from fair share (a fraction of the fleet), at any sample and on
  average;
- the time a tenant that starts waiting below its share takes to reach it (held >= share less 1%): p50 / p99 over
  every burst of every tenant;
- fleet utilisation while jobs wait (devices in use over the fleet, at samples where demand exceeds the fleet);
- job completion time (submission to success): mean and p99;
- the device-time lost to preemption (checkpoint saves and loads, work redone) against the device-time worked;
- the scheduler's longest placement pass and those past their budget (a gen2 garbage collection of the scheduler's
  process, 120-190 ms at this scale under either side, counts when it lands in a pass), late lease renewals, and the
  faults that must not happen;
- where the jobs that did not finish in the run stand, if any.
Run by hand:  python bench/fair_share.py [--nodes 1000 --rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import nats  # noqa: E402

from bench.control_plane import ENDED, pct, until_all_alive  # noqa: E402
from bench.sim_fleet import Fleet  # noqa: E402
from schemas import names  # noqa: E402
from schemas.jobs import Accepted, JobQuery, JobReply, SubmitReply  # noqa: E402
from schemas.tenants import TenantList, TenantsQuery  # noqa: E402
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402

SCHED_LOG = "/tmp/jetlora-bench-fair-share-{side}.log"
SAMPLE_S = 0.25
WEIGHTS = {"acme": 1, "globex": 1, "initech": 2}
enc = msgspec.json.Encoder()
dec_reply = msgspec.json.Decoder(SubmitReply)


def trace(devices: int, seed: int) -> list[tuple[float, str, list[float]]]:
    """(when, tenant, each job's seconds of work) of every burst, from a seeded generator of the recorded shape:
    bursts of long jobs that outnumber the fleet, of medium ones, and a steady beat of short ones."""
    rng = random.Random(seed)

    def burst(t: float, tenant: str, share: float, low: float, high: float):
        return (t, tenant, [round(rng.uniform(low, high), 2) for _ in range(int(devices * share))])

    bursts = [burst(0.0, "acme", 1.1, 15, 30), burst(20.0, "acme", 0.2, 15, 30)]
    bursts += [burst(8.0, "globex", 0.3, 6, 14), burst(24.0, "globex", 0.2, 6, 14)]
    bursts += [burst(4.0 + 5 * i, "initech", 0.02, 1, 4) for i in range(6)]
    return sorted(bursts)


def start_scheduler(url: str, args, side: str) -> subprocess.Popen:
    flags = ["--heartbeat-interval", str(args.interval), "--misses", "3", "--co-train", "off", "--sharing", side]
    flags += ["--min-run-s", str(args.min_run_s), "--preempt-backoff-s", str(args.backoff_s)]
    for tenant, weight in WEIGHTS.items():
        cap = f",devices:{int(args.nodes * args.gpus * args.fifo_cap)}" if side == "fifo" and args.fifo_cap else ""
        flags += ["--quota", f"{tenant}=weight:{weight}{cap}"]
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "scheduler", "--nats", url, *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(SCHED_LOG.format(side=side), "w"),
    )


async def run_once(args, side: str) -> dict:
    """One whole run of the trace against a fresh store: the figures of one side."""
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(store_dir=Path(tmp) / "nats") as server:
        nc = await nats.connect(server.url)
        client = await nats.connect(server.url)
        await bus.ensure_resources(nc)
        sched = start_scheduler(server.url, args, side)
        fleet = Fleet(nc, args.nodes, args.gpus, 0, args.interval)
        await fleet.subscribe()
        beats = asyncio.create_task(fleet.beat_forever())
        await until_all_alive(client, args.nodes)
        out = await drive(args, client, fleet)
        beats.cancel()
        sched.terminate()
        sched.wait(10)
        await nc.close()
        await client.close()
    log = Path(SCHED_LOG.format(side=side)).read_text()
    if m := ENDED.search(log):
        out.update(longest_pass_ms=float(m[2]), cut_short=int(m[3]), renewals_late=int(m[5]))
    out["deposed"] = log.count("Deposed") + log.count("stepping down") + log.count("stopped leading")
    if m := re.search(r"preemptions: (.*)", log):
        out["preempt_log"] = m[1]
    return out


async def drive(args, client, fleet: Fleet) -> dict:
    """Submit the trace on its schedule, sample the shares until every job ended (or --limit-s), and measure."""
    bursts = trace(args.nodes * args.gpus, args.seed)
    submitted: dict[str, tuple[str, float]] = {}  # job -> (tenant, when submitted)
    samples: list[tuple[float, dict]] = []
    rejected: list[str] = []
    sem = asyncio.Semaphore(args.concurrency)
    t0 = time.monotonic()

    async def submit(tenant: str, work: float) -> None:
        job = {"model": "bench", "base_dir": "/models/bench", "data": [{"q": "q?", "a": "a."}], "gpu_mib": 8000}
        job["label"] = f"sim:work={work},step=0.5"
        async with sem:
            at = time.monotonic()
            msg = await client.request(names.jobs_api(tenant).submit, enc.encode(job), timeout=30)
        reply = dec_reply.decode(msg.data)
        if isinstance(reply, Accepted):
            submitted[reply.job] = (tenant, at)
        else:
            rejected.append(str(reply))

    async def play(when: float, tenant: str, works: list[float]) -> None:
        await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
        await asyncio.gather(*(submit(tenant, w) for w in works))

    async def sample() -> None:
        while True:
            try:
                reply = await bus.request(client, names.TENANTS, TenantsQuery(), TenantList, timeout=5)
                samples.append((time.monotonic() - t0, {t.tenant: t for t in reply.tenants}))
            except bus.RequestError:
                pass
            await asyncio.sleep(SAMPLE_S)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(play(*b) for b in bursts))
    total = sum(len(w) for _, _, w in bursts)
    deadline = t0 + args.limit_s
    while time.monotonic() < deadline and sum(j in fleet.done_at for j in submitted) < len(submitted):
        await asyncio.sleep(0.5)
    sampler.cancel()
    left = await leftovers(client, [j for j in submitted if j not in fleet.done_at], fleet)
    return (
        measure(args, bursts, submitted, samples, fleet, t0)
        | left
        | dict(
            jobs=total, accepted=len(submitted), rejected=len(rejected), first_rejection=rejected[0] if rejected else ""
        )
    )


async def leftovers(client, unfinished: list[str], fleet: Fleet) -> dict:
    """Where the jobs that did not finish in the run stand (by state, with an example's message each)."""
    by_state: dict[str, int] = {}
    examples: dict[str, str] = {}
    for job in unfinished[:500]:
        try:
            reply = await bus.request(client, names.GET_JOB, JobQuery(job), JobReply, timeout=5)
        except bus.RequestError as e:
            by_state["unanswered"] = by_state.get("unanswered", 0) + 1
            examples.setdefault("unanswered", str(e))
            continue
        key = f"{reply.job.state}{' (sim runs it)' if job in fleet.running else ''}"
        by_state[key] = by_state.get(key, 0) + 1
        examples.setdefault(key, f"{job} attempt {reply.job.attempt}: {reply.job.message[:200]}")
    return {"unfinished": len(unfinished), "left_states": by_state, "left_examples": examples}


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
            busy.append(sum(r.in_use for r in rows.values()) / devices)
    reach = [r for b in bursts if (r := time_to_share(b, samples)) is not None]
    missed = sum(1 for b in bursts if time_to_share(b, samples) is None)
    done = [fleet.done_at[j] - at for j, (_, at) in submitted.items() if j in fleet.done_at]
    whole = sum(used.values()) or 1.0
    out = {f"share_{t}": used[t] / whole for t in WEIGHTS} | {f"fair_{t}": fair[t] / whole for t in WEIGHTS}
    return out | dict(
        deviation_max=max(deviations, default=0.0),
        deviation_mean=statistics.fmean(deviations) if deviations else 0.0,
        reach_p50=pct(reach, 50),
        reach_p99=pct(reach, 99),
        reach_missed=missed,
        utilisation=statistics.fmean(busy) if busy else float("nan"),
        jct_mean=statistics.fmean(done) if done else float("nan"),
        jct_p99=pct(done, 99),
        finished=len(done),
        lost=fleet.lost_s / max(fleet.work_s + fleet.lost_s, 1e-9),
        preempted=sum(fleet.paused.values()),
        makespan=max(fleet.done_at.values(), default=t0) - t0,
    )


def time_to_share(burst, samples) -> float | None:
    """Seconds from a burst until its tenant held its fair share (less 1%), if it was below it; 0: it never was;
    None: it never got there in the run."""
    when, tenant, _ = burst
    below = False
    for t, rows in samples:
        row = rows.get(tenant)
        if t < when + SAMPLE_S or row is None:
            continue
        if row.in_use >= row.fair_share - max(1, row.fair_share // 100) or not row.queued:
            return t - when if below else 0.0
        below = True
    return None


def report(args, results: dict[str, list[dict]]) -> bool:
    def fig(side, key, fmt=lambda v: f"{v:.2f}") -> str:
        values = [r[key] for r in results[side] if key in r and r[key] == r[key]]
        if not values:
            return "-"
        return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"

    percent = lambda v: f"{v:.1%}"  # noqa: E731
    count = lambda v: f"{v:.0f}"  # noqa: E731
    print(f"\n{args.nodes} agents x {args.gpus} GPUs; tenants {WEIGHTS} (weights); trace seed {args.seed}")
    ok = True
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
            f"{fig(side, 'reach_p99')} s; bursts that never did: {fig(side, 'reach_missed', count)}"
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
        faults = {k: sum(r.get(k, 0) for r in runs) for k in ("deposed", "rejected")}
        print(f"  guarantees: Deposed {faults['deposed']}, submissions refused {faults['rejected']} (0 wanted)")
        for r in runs:
            if r.get("unfinished"):
                print(f"  not finished in the run: {r['unfinished']}: {r['left_states']}")
                for state, example in r["left_examples"].items():
                    print(f"    {state}: {example}")
            if r.get("first_rejection"):
                print(f"  first refusal: {r['first_rejection'][:300]}")
        ok = ok and not any(faults.values())
    if set(results) == {"fifo", "fair"}:
        u = {s: statistics.median(r["utilisation"] for r in results[s]) for s in results}
        print(f"\nutilisation fair / fifo: {u['fair'] / u['fifo']:.3f}")
    return ok


async def main(args) -> int:
    sides = [s for s in args.sides.split(",") if s]
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            print(f"round {r + 1}: --sharing {side} ...", flush=True)
            results[side].append(await run_once(args, side))
    return 0 if report(args, results) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--min-run-s", type=float, default=5.0, help="the scheduler's (the trace's time is compressed)")
    ap.add_argument("--backoff-s", type=float, default=20.0, help="the scheduler's --preempt-backoff-s")
    ap.add_argument(
        "--fifo-cap", type=float, default=0.0, help="fifo: each tenant's devices cap, a fraction of the fleet (0: none)"
    )
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--limit-s", type=float, default=240.0, help="a run ends here even if jobs are left")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each side (sides alternate: ABBA...)")
    ap.add_argument("--sides", default="fifo,fair")
    sys.exit(asyncio.run(main(ap.parse_args())))
