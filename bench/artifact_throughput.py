"""MB/s of a 1 GB artifact through jetlora's chunked path (agent sender -> artifact service -> object store)
against nats-py's own ObjectStore.put of the same file, on one embedded server, in one run.
Run by hand:  python bench/artifact_throughput.py [--mib 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from schemas import names  # noqa: E402
from services.artifacts.sender import upload_file  # noqa: E402
from services.bus import ensure_resources  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


async def main(mib: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(store_dir=Path(tmp) / "nats") as server:
        src = Path(tmp) / "artifact.bin"
        with open(src, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        nc = await nats.connect(server.url)
        await ensure_resources(nc)
        service = subprocess.Popen([sys.executable, "-m", "services.cli", "artifacts", "--nats", server.url],
                                   cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await asyncio.sleep(2.0)
        try:
            obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
            t0 = time.perf_counter()
            with open(src, "rb") as f:
                await obs.put("direct", f)
            direct = mib / (time.perf_counter() - t0)
            await obs.delete("direct")
            t0 = time.perf_counter()
            await upload_file(nc, "bench", "peft", src, timeout=60)
            chunked = mib / (time.perf_counter() - t0)
            rss = peak_rss_mib(service.pid)
        finally:
            service.terminate()
            service.wait(10)
            await nc.close()
    print(f"{mib} MiB artifact on one embedded nats-server")
    print(f"nats-py ObjectStore.put (baseline): {direct:6.1f} MiB/s")
    print(f"jetlora chunked upload:             {chunked:6.1f} MiB/s")
    print(f"ratio chunked/direct: {chunked / direct:.2f}; artifact service peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=1024)
    asyncio.run(main(ap.parse_args().mib))
