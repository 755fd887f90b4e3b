"""The control plane at fleet scale: the real scheduler (its own process) on an embedded nats-server, 1,000
simulated agents with 8 GPUs each heartbeating every second on the real subjects, and 10,000 jobs.
Run by hand:  python bench/control_plane.py [--nodes 1000 --jobs 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
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

from schemas import names  # noqa: E402
from schemas.events import StateChange  # noqa: E402
from schemas.jobs import Accepted, JobStatus, SubmitReply  # noqa: E402
from schemas.nodes import AssignAccepted, Assignment, Device, Heartbeat, NodeList, RunningAttempt  # noqa: E402
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402

GPU_MIB = 81920
SCHED_LOG = "/tmp/jetlora-bench-scheduler.log"
PROFILE = __import__("os").environ.get("BENCH_PROFILE")  # a py-spy output file: profile the scheduler
enc = msgspec.json.Encoder()
dec_assign = msgspec.json.Decoder(Assignment)
dec_reply = msgspec.json.Decoder(SubmitReply)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))] if values else float("nan")


class Fleet:
    """Simulated agents: real heartbeats and replies; each job 'runs' a random short time, then succeeds."""

    def __init__(self, nc, nodes: int, gpus: int, doomed: int, interval: float):
        self.nc, self.js = nc, nc.jetstream()
        self.interval = interval
        self.nodes = {f"node{i:04d}": [None] * gpus for i in range(nodes)}
        self.doomed = set(list(self.nodes)[:doomed])
        self.silenced: set[str] = set()
        self.last_beat: dict[str, float] = {}
        self.assigned_at: dict[str, float] = {}
        self.held: dict[str, str] = {}  # job -> doomed node holding it
        self.attempts: dict[str, int] = {}  # job -> the attempt it runs as
        self.finished: dict[str, list[str]] = {n: [] for n in self.nodes}  # recent, as real agents report them
        self.tasks: set[asyncio.Task] = set()

    def heartbeat(self, node: str) -> bytes:
        devices = [
            Device(
                index=i,
                name="simulated H100",
                total_mib=GPU_MIB,
                free_mib=GPU_MIB - (need if job else 0),
                jobs=[job] if job else [],
            )
            for i, (job, need) in enumerate((j or (None, 0)) for j in self.nodes[node])
        ]
        running = [j for j, _ in filter(None, self.nodes[node])]
        attempts = [
            RunningAttempt(job=slot[0], attempt=self.attempts.get(slot[0], 1), devices=[i], state="running")
            for i, slot in enumerate(self.nodes[node])
            if slot
        ]
        return enc.encode(
            Heartbeat(
                node=node,
                agent_version="sim",
                devices=devices,
                running=running,
                attempts=attempts,
                finished=self.finished[node][-16:],
                interval_s=self.interval,
                sent_at=time.time(),
            )
        )

    async def beat_forever(self):
        order = list(self.nodes)
        while True:
            start = time.monotonic()
            for i, node in enumerate(order):
                if node not in self.silenced:
                    await self.nc.publish(names.node(node).heartbeat, self.heartbeat(node))
                    self.last_beat[node] = time.monotonic()
                if i % 50 == 49:  # spread the fleet's beats over the interval
                    await asyncio.sleep(max(0.0, start + self.interval * (i + 1) / len(order) - time.monotonic()))
            await asyncio.sleep(max(0.0, start + self.interval - time.monotonic()))

    async def on_assign(self, msg):
        now = time.monotonic()
        a = dec_assign.decode(msg.data)
        node = names.node_of_subject(msg.subject)
        self.assigned_at.setdefault(a.job, now)
        self.nodes[node][a.device] = (a.job, a.request.gpu_mib)
        self.attempts[a.job] = a.attempt
        await msg.respond(enc.encode(AssignAccepted(a.job)))
        t = asyncio.create_task(self.run_job(node, a))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def report(self, a: Assignment, node: str, state: str):
        ev = StateChange(job=a.job, state=state, node=node, attempt=a.attempt, message=state, ts=time.time())
        await self.js.publish(names.job(a.job, node, names.tenant_token(a.tenant)).state, enc.encode(ev))

    async def run_job(self, node: str, a: Assignment):
        await self.report(a, node, "running")
        if node in self.doomed:
            self.held[a.job] = node
            return  # held until the node is killed
        await asyncio.sleep(random.uniform(0.5, 3.0))
        await self.report(a, node, "succeeded")
        if self.nodes[node][a.device] and self.nodes[node][a.device][0] == a.job:
            self.nodes[node][a.device] = None
        self.finished[node].append(a.job)


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


async def main(n_nodes: int, n_jobs: int, doomed: int, interval: float, misses: int, concurrency: int) -> None:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(store_dir=Path(tmp) / "nats") as server:
        nc = await nats.connect(server.url)
        client = await nats.connect(server.url)
        await bus.ensure_resources(nc)
        sched = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "scheduler",
                "--nats",
                server.url,
                "--heartbeat-interval",
                str(interval),
                "--misses",
                str(misses),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(SCHED_LOG, "w"),
        )
        pids = {"scheduler": sched.pid, "nats-server": server.proc.pid, "bench (agents, submitter)": os.getpid()}
        fleet = Fleet(nc, n_nodes, 8, doomed, interval)
        await nc.subscribe(names.node("*").assign, cb=fleet.on_assign)

        async def echo(m):
            await m.respond(m.data)

        await nc.subscribe("bench.echo", cb=echo)
        beats = asyncio.create_task(fleet.beat_forever())
        while True:
            try:
                nodes = await bus.request(client, names.LIST_NODES, b"{}", NodeList, timeout=5)
                if sum(n.alive for n in nodes.nodes) >= n_nodes:
                    break
            except bus.RequestError:
                pass
            await asyncio.sleep(0.5)
        spy = (
            subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-p",
                    str(sched.pid),
                    "-o",
                    PROFILE,
                    "-f",
                    "raw",
                    "-r",
                    "200",
                    "-d",
                    "60",
                    "--idle",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if PROFILE
            else None
        )
        print(f"{n_nodes} agents x 8 GPUs heartbeating every {interval}s; window {interval * misses}s")

        floor = []

        async def echo_one():
            t0 = time.perf_counter()
            await client.request("bench.echo", b"x" * 300, timeout=5)
            floor.append(time.perf_counter() - t0)

        submitted_at: dict[str, float] = {}
        latency = []

        async def submit_one():
            t0 = time.monotonic()
            msg = await client.request(names.SUBMIT, job_request(rng), timeout=10)
            latency.append(time.monotonic() - t0)
            reply = dec_reply.decode(msg.data)
            assert isinstance(reply, Accepted), reply
            submitted_at[reply.job] = t0
            return reply.job

        warm, block = 1000, 100
        floor_ratios = []
        for r in range(warm // block):  # sequential, the latency a lone submitter sees, in blocks alternating with
            sides = [echo_one, submit_one]  # the raw round trip, so background load favours neither
            for side in sides if r % 2 == 0 else sides[::-1]:
                for _ in range(block):
                    await side()
            floor_ratios.append(pct(latency[-block:], 50) / pct(floor[-block:], 50))
        seq_latency = list(latency)
        await asyncio.sleep(2)
        seq_ids = list(submitted_at)
        place_seq = [fleet.assigned_at[j] - submitted_at[j] for j in seq_ids if j in fleet.assigned_at]

        latency.clear()
        sem = asyncio.Semaphore(concurrency)

        async def bounded():
            async with sem:
                return await submit_one()

        t0 = time.monotonic()
        cpu0 = {name: proc_stats(pid)[0] for name, pid in pids.items()}
        burst_ids = await asyncio.gather(*(bounded() for _ in range(n_jobs - warm)))
        burst_s = time.monotonic() - t0
        burst_cpu = {name: proc_stats(pid)[0] - cpu0[name] for name, pid in pids.items()}
        burst_latency = list(latency)
        await asyncio.sleep(8)
        place_burst = [fleet.assigned_at[j] - submitted_at[j] for j in burst_ids if j in fleet.assigned_at]

        # kill the doomed nodes at once: their heartbeats stop
        kv = await client.jetstream().key_value(names.JOBS_KV)
        held = {j: n for j, n in fleet.held.items()}
        failed_at: dict[str, float] = {}
        watcher = await kv.watch("status.*", include_history=False)

        async def watch_failures():
            async for entry in watcher:
                if entry is None or entry.value is None:
                    continue
                job = entry.key.split(".", 1)[1]
                if job in held and job not in failed_at:
                    st = msgspec.json.decode(entry.value, type=JobStatus)
                    if st.state in ("failed", "queued"):
                        failed_at[job] = time.monotonic()

        watching = asyncio.create_task(watch_failures())
        await asyncio.sleep(0.5)
        fleet.silenced |= fleet.doomed
        deadline = time.monotonic() + interval * misses + 10
        while len(failed_at) < len(held) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        detect = [failed_at[j] - fleet.last_beat[n] for j, n in held.items() if j in failed_at]
        watching.cancel()
        cpu, rss = proc_stats(sched.pid)
        beats.cancel()
        if spy:
            spy.send_signal(__import__("signal").SIGINT)
            spy.wait(30)
        sched.terminate()
        sched.wait(10)
        await nc.close()
        await client.close()

    ms = lambda s: f"{s * 1000:.2f} ms"  # noqa: E731
    print(f"raw nats-py request/reply round trip (floor): p50 {ms(pct(floor, 50))}, p99 {ms(pct(floor, 99))}")
    print(
        f"submit -> accepted, sequential ({warm}): p50 {ms(pct(seq_latency, 50))}, p99 {ms(pct(seq_latency, 99))} "
        f"({statistics.median(floor_ratios):.1f}x the floor: median of {len(floor_ratios)} alternating blocks, "
        f"{min(floor_ratios):.1f}-{max(floor_ratios):.1f})"
    )
    print(
        f"submit -> accepted, {concurrency} in flight ({n_jobs - warm}): p50 {ms(pct(burst_latency, 50))}, "
        f"p99 {ms(pct(burst_latency, 99))}"
    )
    print(f"sustained durable submissions: {(n_jobs - warm) / burst_s:.0f}/s")
    print(
        "CPU per submission in the burst (each job also placed and run): "
        + ", ".join(f"{name} {cpu / (n_jobs - warm) * 1e6:.0f} us" for name, cpu in burst_cpu.items())
        + f" ({burst_s:.1f}s, 2 cores here)"
    )
    print(
        f"submit -> assignment with free GPUs (sequential): p50 {ms(pct(place_seq, 50))}, p99 {ms(pct(place_seq, 99))} "
        f"({len(place_seq)} placed)"
    )
    print(
        f"submit -> assignment in the burst (queueing included): p50 {ms(pct(place_burst, 50))}, "
        f"p99 {ms(pct(place_burst, 99))} ({len(place_burst)} of {len(burst_ids)} placed within 8 s)"
    )
    window = interval * misses
    if detect:
        print(
            f"{doomed} agents killed at once: {len(detect)} of {len(held)} jobs failed; last heartbeat -> failed "
            f"p50 {statistics.median(detect):.2f}s, max {max(detect):.2f}s (window {window:.1f}s, target <= {window + 0.5:.1f}s)"
        )
    else:
        print(f"{doomed} agents killed: none of their {len(held)} jobs was seen failing")
    print(f"scheduler: {cpu:.1f} CPU seconds, peak RSS {rss:.0f} MiB with {n_jobs} jobs known")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--doomed", type=int, default=50)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--misses", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=200)
    a = ap.parse_args()
    asyncio.run(main(a.nodes, a.jobs, a.doomed, a.interval, a.misses, a.concurrency))
