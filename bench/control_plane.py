"""The control plane at fleet scale: the real scheduler (its own process) on an embedded nats-server, 1,000
simulated agents with 8 GPUs each heartbeating every second on the real subjects (bench/sim_fleet.py), and 10,000
jobs of one tenant and one base model: a burst a co-training scheduler groups. Each round runs the whole bench once
with co-training at the default (`same-tenant`) and once with `off`, sides alternating (ABBA), a fresh store each.

Printed per side (median of the rounds, then their range): sustained durable submits/s, placement p50/p99 with free
GPUs, the longest placement pass, lease renewals the loop made late, and the faults that must never happen: a
Deposed leader, a submission refused, a job placed twice (attempt 2).
Run by hand:  python bench/control_plane.py [--nodes 1000 --jobs 10000 --rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
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

from bench.sim_fleet import Fleet  # noqa: E402
from schemas import names  # noqa: E402
from schemas.jobs import Accepted, JobStatus, SubmitReply  # noqa: E402
from schemas.nodes import NodeList  # noqa: E402
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402

SCHED_LOG = "/tmp/jetlora-bench-scheduler-{side}.log"
enc = msgspec.json.Encoder()
dec_reply = msgspec.json.Decoder(SubmitReply)
ENDED = re.compile(
    r"leading ended: (\d+) placement passes \(longest ([\d.]+) ms, (\d+) past their budget\); (\d+) lease "
    r"renewals \((\d+) late, the latest (\d+) ms"
)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))] if values else float("nan")


def proc_stats(pid: int) -> tuple[float, float]:
    """CPU seconds (user+system) and peak RSS MiB of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    return cpu, hwm


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


def start_scheduler(url: str, args, side: str) -> subprocess.Popen:
    flags = ["--heartbeat-interval", str(args.interval), "--misses", str(args.misses), "--co-train", side]
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "scheduler", "--nats", url, *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(SCHED_LOG.format(side=side), "w"),
    )


def profile(pid: int, side: str) -> subprocess.Popen | None:
    """With BENCH_PROFILE=DIR, py-spy records the scheduler of each side for a minute (DIR/<side>.txt)."""
    out = os.environ.get("BENCH_PROFILE")
    if not out:
        return None
    Path(out).mkdir(parents=True, exist_ok=True)
    command = ["py-spy", "record", "-p", str(pid), "-o", f"{out}/{side}.txt", "-f", "raw", "-r", "200", "-d", "60"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def until_all_alive(client, n_nodes: int) -> None:
    while True:
        try:
            nodes = await bus.request(client, names.LIST_NODES, b"{}", NodeList, timeout=5)
            if sum(n.alive for n in nodes.nodes) >= n_nodes:
                return
        except bus.RequestError:
            pass
        await asyncio.sleep(0.5)


async def echo(msg) -> None:
    await msg.respond(msg.data)


async def run_once(args, side: str) -> dict:
    """One whole run against a fresh store: the figures of one side."""
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(store_dir=Path(tmp) / "nats") as server:
        nc = await nats.connect(server.url)
        client = await nats.connect(server.url)
        await bus.ensure_resources(nc)
        sched = start_scheduler(server.url, args, side)
        fleet = Fleet(nc, args.nodes, 8, args.doomed, args.interval)
        await nc.subscribe(names.node("*").assign, cb=fleet.on_assign)
        await nc.subscribe("bench.echo", cb=echo)
        beats = asyncio.create_task(fleet.beat_forever())
        await until_all_alive(client, args.nodes)
        spy = profile(sched.pid, side)
        out = await _measure(args, rng, client, fleet, sched)
        if spy:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        beats.cancel()
        sched.terminate()
        sched.wait(10)
        await nc.close()
        await client.close()
    log = Path(SCHED_LOG.format(side=side)).read_text()
    if m := ENDED.search(log):
        out.update(passes=int(m[1]), longest_pass_ms=float(m[2]), cut_short=int(m[3]))
        out.update(renewals=int(m[4]), renewals_late=int(m[5]), latest_renewal_ms=float(m[6]))
    out["deposed"] = log.count("Deposed") + log.count("stepping down") + log.count("stopped leading")
    out["refused_by_sim"] = fleet.refused
    return out


async def _measure(args, rng, client, fleet: Fleet, sched) -> dict:
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


def report(args, results: dict[str, list[dict]]) -> bool:
    """Print each side's figures; False when a run broke a guarantee."""
    ms = lambda s: f"{s * 1000:.2f} ms"  # noqa: E731

    def fig(side: str, key: str, fmt=lambda v: f"{v:.0f}") -> str:
        values = [r[key] for r in results[side] if key in r]
        if not values:
            return "-"
        return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"

    print(f"{args.nodes} agents x 8 GPUs heartbeating every {args.interval}s; {args.jobs} jobs of one tenant and base")
    ok = True
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
            f"{fig(side, 'detect_max', lambda v: f'{v:.2f}')} s (window {args.interval * args.misses:.1f} s)"
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
        ok = ok and not any(faults.values())
    if len(results) == 2:
        on, off = ([r["submits_per_s"] for r in results[s]] for s in results)
        print(f"\nsubmits/s, co-training on / off: {statistics.median(on) / statistics.median(off):.2f}x")
    return ok


async def main(args) -> int:
    sides = [s for s in args.sides.split(",") if s]
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            print(f"round {r + 1}: --co-train {side} ...", flush=True)
            results[side].append(await run_once(args, side))
    return 0 if report(args, results) else 1


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
