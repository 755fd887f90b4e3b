"""A scheduler over a long history: a jobs bucket filled directly (in the stored format; the fill is not timed) with
1,000,000 finished jobs and 1,000 active ones, against one with 1,000 finished and 1,000 active, each on its own
embedded nats-server. In alternating rounds a fresh scheduler process takes over each: its takeover time (start to
leading), its RSS after takeover, submit latency (p50/p99 over all rounds' submissions) and `jobs --limit 50`.
Run by hand:  python bench/history.py [--finished 1000000 --active 1000 --rounds 3 --submits 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import nats  # noqa: E402

from schemas import names  # noqa: E402
from schemas.jobs import Accepted, JobRequest  # noqa: E402
from schemas.job_status import JobList, JobListQuery, JobStatus, StoredRequest  # noqa: E402
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402
from services.scheduler.index import Finished  # noqa: E402
from schemas.job_records import JOBS, LAYOUT, active_key, request_key, status_key  # noqa: E402

JOB = {
    "model": "tiny",
    "base_dir": "/models/tiny",
    "data": [{"q": "What is the capital of France?", "a": "Paris"}],
    "node": "nowhere",
}  # pinned to a node that never comes: the active jobs stay queued
_enc = msgspec.json.Encoder()

# the scheduler process: prints its takeover time and RSS, then serves until its stdin closes
SCHEDULER = """
import asyncio, sys, time
t0 = time.monotonic()
import nats
from services.scheduler.service import Scheduler, SchedulerConfig
async def main():
    nc = await nats.connect(sys.argv[1])
    s = Scheduler(nc, SchedulerConfig(heartbeat_interval=1.0))
    stop = asyncio.Event()
    task = asyncio.create_task(s.run(stop))
    await s.leading.wait()
    took = time.monotonic() - t0
    rss = int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
    print(f"{took:.3f} {rss}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    stop.set(); await task; await nc.drain()
asyncio.run(main())
"""


async def fill(url: str, finished: int, active: int) -> None:
    """Write jobs as the scheduler stores them: request, status, index entries, and the active mark."""
    nc = await nats.connect(url)
    await bus.ensure_resources(nc)
    js = nc.jetstream(publish_async_max_pending=1000)  # acknowledged, so the server's back-pressure drops nothing
    pending: list = []

    async def put(subject: str, payload: bytes) -> None:
        pending.append(await js.publish_async(subject, payload))
        if len(pending) >= 5000:
            await asyncio.gather(*pending)  # raises if any was refused
            pending.clear()

    request = msgspec.convert(JOB, type=JobRequest)
    started = time.monotonic()
    seq = 0
    for i in range(finished + active):
        job = uuid.uuid4().hex[:16]
        seq += 1  # index entries: one per job in submission order, one per finished job (both published below)
        submitted_seq = seq
        await put(names.job_index_submitted(names.ADMIN_TENANT), job.encode())
        stored = StoredRequest(id=job, request=request, created=time.time(), seq=i + 1, index_seq=submitted_seq)
        await put(JOBS.prefix + request_key(job), _enc.encode(stored))
        if i < finished:
            status = JobStatus(state="succeeded", message="done", updated=time.time(), step=10, steps=10, attempt=1)
            await put(JOBS.prefix + status_key(job), _enc.encode(status))
            seq += 1
            await put(
                names.job_index_finished(names.ADMIN_TENANT, "succeeded"),
                _enc.encode(
                    Finished(
                        job=job, tenant=None, state="succeeded", finished=status.updated, submitted_seq=submitted_seq
                    )
                ),
            )
        else:
            await put(JOBS.prefix + active_key(job), b"")
    await asyncio.gather(*pending)
    await js.publish(JOBS.prefix + LAYOUT, _enc.encode(2))
    await nc.flush()
    info = await js.stream_info(names.JOB_INDEX_STREAM)
    if info.state.last_seq != seq:
        raise SystemExit(f"the index has {info.state.last_seq} entries, not {seq}: the fill lost messages")
    print(f"  filled {finished:,} finished + {active:,} active in {time.monotonic() - started:.0f}s", flush=True)
    await nc.close()


async def one_round(url: str, submits: int, listings: int) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCHEDULER, url], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    took, rss = (await asyncio.to_thread(proc.stdout.readline)).split()
    nc = await nats.connect(url)
    lat, listing = [], []
    for _ in range(submits):
        t = time.perf_counter()
        assert isinstance(await bus.request(nc, names.SUBMIT, JOB, Accepted), Accepted)
        lat.append(time.perf_counter() - t)
    for _ in range(listings):
        t = time.perf_counter()
        page = await bus.request(nc, names.LIST_JOBS, JobListQuery(limit=50), JobList)
        listing.append(time.perf_counter() - t)
        assert len(page.jobs) == 50
    await nc.close()
    proc.stdin.close()
    proc.wait(timeout=30)
    return {"takeover": float(took), "rss": int(rss), "submit": lat, "list": listing}


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--finished", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=1_000)
    ap.add_argument("--active", type=int, default=1_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--submits", type=int, default=1_000, help="in all, spread over the rounds")
    ap.add_argument("--listings", type=int, default=30, help="per round")
    args = ap.parse_args()
    servers = {}
    for side, finished in (("small", args.small), ("large", args.finished)):
        servers[side] = EmbeddedNats(store_dir=Path(tempfile.mkdtemp(prefix=f"history-{side}-"))).start()
        await fill(servers[side].url, finished, args.active)
    results: dict[str, list[dict]] = {"small": [], "large": []}
    try:
        for r in range(args.rounds):
            for side in ("small", "large") if r % 2 == 0 else ("large", "small"):
                results[side].append(await one_round(servers[side].url, args.submits // args.rounds, args.listings))
    finally:
        for s in servers.values():
            s.stop()
            shutil.rmtree(s.store_dir, ignore_errors=True)  # a million jobs are about 1.7 GB
    figures = {}
    for side, rounds in results.items():
        submits = [x for r in rounds for x in r["submit"]]
        lists = [x for r in rounds for x in r["list"]]
        figures[side] = dict(
            takeover=statistics.median(r["takeover"] for r in rounds),
            rss=max(r["rss"] for r in rounds),
            p50=pct(submits, 0.5) * 1e3,
            p99=pct(submits, 0.99) * 1e3,
            list=statistics.median(lists) * 1e3,
        )
    print(f"{'':8}{'takeover s':>12}{'RSS MiB':>10}{'submit p50 ms':>15}{'submit p99 ms':>15}{'jobs -l 50 ms':>15}")
    for side, f in figures.items():
        n = args.small if side == "small" else args.finished
        print(f"{n:>8,}{f['takeover']:>12.2f}{f['rss']:>10}{f['p50']:>15.2f}{f['p99']:>15.2f}{f['list']:>15.2f}")
    s, big = figures["small"], figures["large"]
    print(
        f"ratio   {big['takeover'] / s['takeover']:>12.2f}{big['rss'] / s['rss']:>10.2f}{big['p50'] / s['p50']:>15.2f}"
        f"{big['p99'] / s['p99']:>15.2f}{big['list'] / s['list']:>15.2f}   (large / small)"
    )


if __name__ == "__main__":
    asyncio.run(main())
