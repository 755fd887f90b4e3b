"""What the term's fence costs a status write: the same writes to the jobs bucket through the scheduler's JobStore
with a fence (the term key's revision checked by JetStream on every write) and without, in alternating rounds.

Run by hand:  python bench/fenced_writes.py [--rounds 10 --writes 2000 --concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from schemas import names  # noqa: E402
from schemas.job_status import JobStatus  # noqa: E402
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402
from services.scheduler.store import JobStore  # noqa: E402


async def one_round(store: JobStore, writes: int, concurrency: int, tag: str) -> float:
    """Writes a second: `writes` statuses of as many jobs, `concurrency` at once."""
    slots = asyncio.Semaphore(concurrency)
    status = JobStatus(state="running", node="node0001", device=3, attempt=1, message="training 400 steps on cuda")

    async def write(i: int) -> None:
        async with slots:
            await store.write_status(f"{tag}{i:06d}", status)

    t0 = time.perf_counter()
    await asyncio.gather(*(write(i) for i in range(writes)))
    return writes / (time.perf_counter() - t0)


async def main(rounds: int, writes: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(store_dir=Path(tmp) / "nats") as server:
        nc = await nats.connect(server.url)
        await bus.ensure_resources(nc)
        js = nc.jetstream()
        kv = await js.key_value(names.JOBS_KV)
        plain, fenced = JobStore(js, kv), JobStore(js, kv)
        await fenced.take_term("bench", lambda: True)
        rates: dict[str, list[float]] = {"plain": [], "fenced": []}
        for r in range(rounds):
            sides = [("plain", plain), ("fenced", fenced)]
            for name, store in sides if r % 2 == 0 else sides[::-1]:
                rates[name].append(await one_round(store, writes, concurrency, f"{name[0]}{r}-"))
        await nc.close()
    for name, values in rates.items():
        print(f"{name:7s} {statistics.median(values):7.0f} writes/s (rounds {min(values):.0f}-{max(values):.0f})")
    ratios = [f / p for f, p in zip(rates["fenced"], rates["plain"])]
    print(
        f"fenced / plain: {statistics.median(ratios):.3f} (median of {rounds} alternating rounds, "
        f"{min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--writes", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    a = p.parse_args()
    asyncio.run(main(a.rounds, a.writes, a.concurrency))
