"""MiB/s of an artifact through jetlora's chunked path (agent sender -> artifact service -> object store)
against nats-py's own ObjectStore.put of the same file, on one embedded server, in one run: the sides alternate
round by round (A B, B A, ...) so background load favours neither, and the median ratio and its spread are
reported. Run by hand:  python bench/artifact_throughput.py [--mib 256 --rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
from services.transfer.sender import upload_file  # noqa: E402
from tests.conftest import running_on  # noqa: E402
from services.bus import ensure_resources  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


async def answering(nc) -> None:
    """Until the artifact service answers its list requests (it has started)."""
    from services import bus

    deadline = time.monotonic() + 30
    while True:
        try:
            await bus.request(nc, names.ARTIFACTS_LIST, b"{}", msgspec.Raw, timeout=1)
            return
        except bus.RequestError:
            if time.monotonic() > deadline:
                raise


async def main(mib: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(store_dir=Path(tmp) / "nats") as server:
        src = Path(tmp) / "artifact.bin"
        with open(src, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        nc = await nats.connect(server.url)
        await ensure_resources(nc)
        service = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "artifacts", "--nats", server.url],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await answering(nc)
            obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)

            async def direct(r: int) -> float:
                t0 = time.perf_counter()
                with open(src, "rb") as f:
                    await obs.put(f"direct-{r}", f)
                took = time.perf_counter() - t0
                await obs.delete(f"direct-{r}")
                return mib / took

            async def chunked(r: int) -> float:
                await running_on(nc, f"bench{r}")
                t0 = time.perf_counter()
                await upload_file(nc, "n1", f"bench{r}", "peft", src, timeout=60)
                took = time.perf_counter() - t0
                await obs.delete(names.artifact_name(f"bench{r}", "peft"))
                return mib / took

            results = []
            for r in range(rounds):
                sides = [("direct", direct), ("chunked", chunked)]
                results.append({name: await side(r) for name, side in (sides if r % 2 == 0 else sides[::-1])})
                print(
                    f"  round {r + 1}: direct {results[-1]['direct']:6.1f} MiB/s, chunked "
                    f"{results[-1]['chunked']:6.1f} MiB/s",
                    flush=True,
                )
            rss = peak_rss_mib(service.pid)
        finally:
            service.terminate()
            service.wait(10)
            await nc.close()
    ratios = sorted(r["chunked"] / r["direct"] for r in results)
    median = lambda side: statistics.median(r[side] for r in results)  # noqa: E731
    print(f"{mib} MiB artifact on one embedded nats-server, {rounds} rounds")
    print(f"nats-py ObjectStore.put (baseline): {median('direct'):6.1f} MiB/s (median)")
    print(f"jetlora chunked upload:             {median('chunked'):6.1f} MiB/s (median)")
    print(
        f"ratio chunked/direct: median {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}); "
        f"artifact service peak RSS {rss:.0f} MiB"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    asyncio.run(main(args.mib, args.rounds))
