"""The control plane at fleet scale: the real scheduler (its own process) on an embedded nats-server, 1,000
simulated agents with 8 GPUs each heartbeating every second on the real subjects (bench/sim_fleet.py; the start-up
and teardown of both in bench/fleet_bench.py), and 10,000 jobs of one tenant and one base model: a burst a
co-training scheduler groups. Each round runs the whole bench once with co-training at the default (`same-tenant`)
and once with `off`, sides alternating (ABBA), a fresh store each.

Printed per side (median of the rounds, then their range): sustained durable submits/s, scheduler CPU per
submission, placement p50/p99 with free GPUs, the longest placement pass, lease renewals the loop made late, how soon
the jobs of killed agents were given back, and the faults that must never happen: a Deposed leader, a submission
refused, a job placed twice (attempt 2) with no fault of its own. It exits non-zero naming each guarantee that broke
(those faults; a killed agent's job not given back within the window and a heartbeat; a lease renewal a whole
renewal interval late). BENCH_PROFILE=DIR: py-spy samples the scheduler through each burst into DIR/<side>.txt.
Run by hand:  python bench/control_plane.py [--nodes 1000 --jobs 10000 --rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import nats  # noqa: E402

from bench.fleet_bench import ENDED, figure, pct, proc_stats, profiled, sim_stack, until_all_alive  # noqa: E402, F401
from bench.guarantees import Guarantees  # noqa: E402
from bench.sim_fleet import Fleet  # noqa: E402
from schemas import names  # noqa: E402
from schemas.jobs import Accepted, SubmitReply  # noqa: E402
from schemas.job_status import JobStatus  # noqa: E402
from services.bus import LEASE_TTL_S  # noqa: E402
from services.scheduler.lease import RENEWALS_PER_TTL  # noqa: E402

SCHED_LOG = "/tmp/jetlora-bench-scheduler-{side}.log"
RENEWAL_S = LEASE_TTL_S / RENEWALS_PER_TTL  # how often the scheduler renews its lease
enc = msgspec.json.Encoder()
dec_reply = msgspec.json.Decoder(SubmitReply)


def job_request(rng: random.Random) -> bytes:
    return enc.encode(
        {
            "model": "bench",
            "base_dir": "/models/bench",
            "data": [{"q": "q?", "a": "a."}],
            "gpu_mib": rng.choice([8000, 16000, 24000, 40000, 80000]),
            "priority": rng.randint(-5, 5),
        }
    )


async def echo(msg) -> None:
    await msg.respond(msg.data)


async def run_once(args, side: str) -> dict:
    """One whole run against a fresh store: the figures of one side."""
    rng = random.Random(0)
    flags = ["--heartbeat-interval", str(args.interval), "--misses", str(args.misses), "--co-train", side]
    log = SCHED_LOG.format(side=side)
    async with sim_stack(flags, log, args.nodes, 8, args.doomed, args.interval) as run:
        # the echo on a connection of its own: on the fleet's, which carries a thousand agents' traffic, a round
        # trip now and then found no responder (NoRespondersError ended the run before it measured anything)
        echoer = await nats.connect(run.nc.connected_url.geturl())
        try:
            await echoer.subscribe("bench.echo", cb=echo)
            await echoer.flush()  # the server knows the echo's subscription before the first round trip asks for it
            out = await _measure(args, rng, run.client, run.fleet, run.sched, side)
        finally:
            await echoer.close()
    out.update(run.figures())
    out["refused_by_sim"] = run.fleet.refused
    log_lines = Path(log).read_text().splitlines()
    out["again_log"] = [line for job in out.pop("again_examples") for line in log_lines if job in line][:8]
    return out


async def _measure(args, rng, client, fleet: Fleet, sched, side: str) -> dict:
    floor: list[float] = []
    submitted_at: dict[str, float] = {}
    latency: list[float] = []
    rejected: list[str] = []

    async def echo_one():
        t0 = time.perf_counter()
        await client.request("bench.echo", b"x" * 300, timeout=5)
        floor.append(time.perf_counter() - t0)

    async def submit_one():
        t0 = time.monotonic()
        msg = await client.request(names.SUBMIT, job_request(rng), timeout=10)
        latency.append(time.monotonic() - t0)
        reply = dec_reply.decode(msg.data)
        if not isinstance(reply, Accepted):
            rejected.append(str(reply))
            return None
        submitted_at[reply.job] = t0
        return reply.job

    warm, block = 1000, 100
    for r in range(warm // block):  # sequential, the latency a lone submitter sees, alternating with the raw round
        sides = [echo_one, submit_one]  # trip, so background load favours neither
        for each in sides if r % 2 == 0 else sides[::-1]:
            for _ in range(block):
                await each()
    seq_latency = list(latency)
    await asyncio.sleep(2)
    place_seq = [fleet.assigned_at[j] - submitted_at[j] for j in list(submitted_at) if j in fleet.assigned_at]
    latency.clear()
    sem = asyncio.Semaphore(args.concurrency)

    async def bounded():
        async with sem:
            return await submit_one()

    with profiled(sched.pid, side):  # BENCH_PROFILE=DIR: where the scheduler's time goes in the burst
        t0 = time.monotonic()
        cpu0 = proc_stats(sched.pid)[0]
        burst_ids = [j for j in await asyncio.gather(*(bounded() for _ in range(args.jobs - warm))) if j]
        burst_s = time.monotonic() - t0
        burst_cpu = proc_stats(sched.pid)[0] - cpu0
    burst_latency = list(latency)
    await asyncio.sleep(8)
    place_burst = [fleet.assigned_at[j] - submitted_at[j] for j in burst_ids if j in fleet.assigned_at]
    again = {j for j, n in fleet.assigns.items() if n > 1} | {j for j, a in fleet.attempts.items() if a > 1}
    detect = await _kill_doomed(args, client, fleet)  # their jobs are placed again, as they should be
    cpu, rss = proc_stats(sched.pid)
    return dict(
        floor_p50=pct(floor, 50),
        seq_p50=pct(seq_latency, 50),
        seq_p99=pct(seq_latency, 99),
        burst_p50=pct(burst_latency, 50),
        burst_p99=pct(burst_latency, 99),
        submits_per_s=(args.jobs - warm) / burst_s,
        cpu_per_submit_us=burst_cpu / (args.jobs - warm) * 1e6,
        place_p50=pct(place_seq, 50),
        place_p99=pct(place_seq, 99),
        burst_place_p50=pct(place_burst, 50),
        burst_placed=len(place_burst),
        burst_accepted=len(burst_ids),
        rejected=len(rejected),
        placed_again=len(again),
        again_examples=sorted(again)[:2],
        first_rejection=rejected[0] if rejected else "",
        detect_max=max(detect) if detect else float("nan"),
        detected=len(detect),
        held=len(fleet.held),
        cpu_s=cpu,
        rss_mib=rss,
    )


async def _kill_doomed(args, client, fleet: Fleet) -> list[float]:
    """The doomed agents' heartbeats stop at once: how long until each of their jobs failed or was re-queued."""
    kv = await client.jetstream().key_value(names.JOBS_KV)
    held = dict(fleet.held)
    failed_at: dict[str, float] = {}
    watcher = await kv.watch("status.*", include_history=False)

    async def watch_failures():
        async for entry in watcher:
            if entry is None or entry.value is None:
                continue
            job = entry.key.split(".", 1)[1]
            if job in held and job not in failed_at:
                if msgspec.json.decode(entry.value, type=JobStatus).state in ("failed", "queued"):
                    failed_at[job] = time.monotonic()

    watching = asyncio.create_task(watch_failures())
    await asyncio.sleep(0.5)
    fleet.silenced |= fleet.doomed
    deadline = time.monotonic() + args.interval * args.misses + 10
    while len(failed_at) < len(held) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    watching.cancel()
    return [failed_at[j] - fleet.last_beat[n] for j, n in held.items() if j in failed_at]


def report(args, results: dict[str, list[dict]]) -> Guarantees:
    """Print each side's figures, and check its guarantees (each broken one named at the end)."""
    ms = lambda s: f"{s * 1000:.2f} ms"  # noqa: E731
    promises = Guarantees()

    def fig(side: str, key: str, fmt=lambda v: f"{v:.0f}") -> str:
        return figure([r[key] for r in results[side] if key in r], fmt)

    window = args.interval * args.misses
    print(f"{args.nodes} agents x 8 GPUs heartbeating every {args.interval}s; {args.jobs} jobs of one tenant and base")
    for side, runs in results.items():
        print(f"\n--co-train {side} ({len(runs)} runs; median (range))")
        print(f"  raw request/reply round trip p50: {fig(side, 'floor_p50', ms)}")
        print(f"  submit -> accepted, sequential: p50 {fig(side, 'seq_p50', ms)}, p99 {fig(side, 'seq_p99', ms)}")
        print(
            f"  submit -> accepted, {args.concurrency} in flight: p50 {fig(side, 'burst_p50', ms)}, "
            f"p99 {fig(side, 'burst_p99', ms)}"
        )
        print(f"  sustained durable submissions: {fig(side, 'submits_per_s')}/s")
        print(f"  scheduler CPU per submission in the burst: {fig(side, 'cpu_per_submit_us')} us")
        print(
            f"  submit -> assignment with free GPUs: p50 {fig(side, 'place_p50', ms)}, p99 {fig(side, 'place_p99', ms)}"
        )
        print(f"  burst placed within 8 s: {fig(side, 'burst_placed')} of {fig(side, 'burst_accepted')}")
        print(
            f"  placement passes: {fig(side, 'passes')}, longest {fig(side, 'longest_pass_ms', lambda v: f'{v:.1f}')} "
            f"ms, past their 10 ms budget {fig(side, 'cut_short')}"
        )
        print(
            f"  lease renewals: {fig(side, 'renewals')}, late {fig(side, 'renewals_late')} "
            f"(the latest {fig(side, 'latest_renewal_ms')} ms after due)"
        )
        print(
            f"  killed agents' jobs detected: {fig(side, 'detected')} of {fig(side, 'held')}, the last in "
            f"{fig(side, 'detect_max', lambda v: f'{v:.2f}')} s (window {window:.1f} s)"
        )
        print(f"  scheduler: {fig(side, 'cpu_s')} CPU s, peak RSS {fig(side, 'rss_mib')} MiB")
        faults = {k: sum(r.get(k, 0) for r in runs) for k in ("deposed", "rejected", "placed_again")}
        print(
            f"  guarantees: Deposed {faults['deposed']}, submissions refused {faults['rejected']}, jobs placed "
            f"again {faults['placed_again']} (all 0 wanted)"
        )
        for r in runs:
            if r.get("first_rejection"):
                print(f"  first refusal: {r['first_rejection'][:300]}")
            for line in r.get("again_log", []):
                print(f"  placed again: {line[:300]}")
        _check(promises, side, runs, faults, args)
    if len(results) == 2:
        on, off = ([r["submits_per_s"] for r in results[s]] for s in results)
        print(f"\nsubmits/s, co-training on / off: {statistics.median(on) / statistics.median(off):.2f}x")
    return promises


def _check(promises: Guarantees, side: str, runs: list[dict], faults: dict, args) -> None:
    """The guarantees of one side, over all its runs."""
    window = args.interval * args.misses
    late = max((r.get("latest_renewal_ms", 0.0) for r in runs), default=0.0)
    undetected = sum(r["held"] - r["detected"] for r in runs)
    slowest = max((r["detect_max"] for r in runs if r["detected"]), default=0.0)
    promises.check(faults["deposed"] == 0, f"--co-train {side}: the leader never stopped leading ({faults['deposed']})")
    promises.check(faults["rejected"] == 0, f"--co-train {side}: no submission refused ({faults['rejected']})")
    promises.check(
        faults["placed_again"] == 0,
        f"--co-train {side}: no job placed a second time without a fault ({faults['placed_again']} were)",
    )
    promises.check(
        undetected == 0 and slowest <= window + args.interval,
        f"--co-train {side}: every job of a killed agent failed or re-queued within the window and a heartbeat "
        f"({window + args.interval:.1f} s; {undetected} not, the last in {slowest:.2f} s)",
    )
    promises.check(
        late < RENEWAL_S * 1000,
        f"--co-train {side}: no lease renewal a whole renewal interval late ({RENEWAL_S * 1000:.0f} ms; the latest "
        f"{late:.0f} ms)",
    )


async def main(args) -> int:
    sides = [s for s in args.sides.split(",") if s]
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            print(f"round {r + 1}: --co-train {side} ...", flush=True)
            results[side].append(await run_once(args, side))
    return report(args, results).verdict()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--doomed", type=int, default=50)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--misses", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each side (sides alternate: ABBA...)")
    ap.add_argument("--sides", default="same-tenant,off", help="the --co-train policies to compare")
    sys.exit(asyncio.run(main(ap.parse_args())))
