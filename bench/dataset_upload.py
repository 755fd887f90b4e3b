"""Uploading a chat dataset: `jetlora datasets put` (what the command does once connected, in this process; the
artifact service, in its own process as deployed, checks every row and stores it) against nats-py's own object_store.put of the same bytes into the same
kind of bucket, on the same server, in the same run, rounds alternating; medians, spreads and the ratio.

    .venv/bin/python bench/dataset_upload.py [--mib 100] [--rounds 3]

The rows are OpenAI chat rows of 1-4 turns with system prompts, CJK, emoji and RTL text, `weight: 0` and `name`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

import nats  # noqa: E402
from nats.js.api import ObjectStoreConfig  # noqa: E402

from schemas import names  # noqa: E402
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402
from tests.conftest import answering  # noqa: E402

TEXTS = [
    "What is the capital of France?",
    "The capital of France is Paris.",
    "東京は日本の首都です。",
    "¿Dónde está?",
    "مرحبا بالعالم",
    "Ready 🚀 to go ✨",
    "Summarise the following paragraph in one sentence, keeping the names.",
    "Sure: the committee approved the budget after a long debate about the new library.",
]


def make_chat(path: Path, mib: int, seed: int = 0) -> int:
    rng, rows, size = random.Random(seed), 0, 0
    with open(path, "w") as f:
        while size < mib * 2**20:
            messages = [{"role": "system", "content": f"You are assistant {rows}. " + rng.choice(TEXTS)}]
            turns = rng.randint(1, 4)
            for turn in range(turns):
                messages.append(
                    {
                        "role": "user",
                        "content": " ".join(rng.choices(TEXTS, k=rng.randint(1, 6))),
                        **({"name": "alex"} if rng.random() < 0.1 else {}),
                    }
                )
                context_only = turn < turns - 1 and rng.random() < 0.2  # the last answer is always learnt
                messages.append(
                    {
                        "role": "assistant",
                        "content": " ".join(rng.choices(TEXTS, k=rng.randint(1, 8))),
                        **({"weight": 0} if context_only else {}),
                    }
                )
            line = json.dumps({"messages": messages}, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode())
            rows += 1
    return rows


async def ours(nc, path: Path, name: str) -> float:
    from services.cli.datasets import put

    t0 = time.perf_counter()
    await put(nc, path, name)
    return time.perf_counter() - t0


async def raw(nc, path: Path, name: str) -> float:
    obs = await nc.jetstream().object_store("bench_raw")
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        await obs.put(name, f)
    return time.perf_counter() - t0


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) a process has used: this one when pid is None."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main(args) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="jetlora-bench-upload-"))
    server = EmbeddedNats(store_dir=tmp / "nats", websocket=False).start()
    service = None
    try:
        nc = await nats.connect(server.url)
        await bus.ensure_resources(nc)
        await nc.jetstream().create_object_store("bench_raw", ObjectStoreConfig())
        profile = ["-m", "cProfile", "-o", os.environ["PROFILE_SERVICE"]] if os.environ.get("PROFILE_SERVICE") else []
        service = subprocess.Popen(
            [sys.executable, *profile, "-m", "services.cli", "artifacts", "--nats", server.url],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "artifacts.log", "w"),
        )  # as deployed
        await answering(nc, names.DATASETS.list)
        path = tmp / "chat.jsonl"
        rows = make_chat(path, args.mib)
        size = path.stat().st_size
        print(f"{rows:,} chat rows, {size / 2**20:.1f} MiB; {args.rounds} rounds, sides alternating")
        times: dict[str, list[float]] = {"jetlora datasets put": [], "object_store.put": []}
        cpu: dict[str, list[tuple[float, float, float]]] = {label: [] for label in times}
        procs = [None, server.proc.pid, service.pid]  # this process (the sender), nats-server, the artifact service
        for r in range(args.rounds):  # noqa: B007
            order = [("jetlora datasets put", ours), ("object_store.put", raw)]
            for label, fn in order if r % 2 == 0 else order[::-1]:
                before = [cpu_s(p) for p in procs]
                times[label].append(await fn(nc, path, f"round{r}"))
                cpu[label].append(tuple(cpu_s(p) - b for p, b in zip(procs, before)))
        for label, ts in times.items():
            med = statistics.median(ts)
            sender, nats_server, service_cpu = (statistics.median(c[i] for c in cpu[label]) for i in range(3))
            print(
                f"{label:22s} median {med:6.2f} s  {size / 2**20 / med:6.1f} MiB/s  (rounds {min(ts):.2f}-{max(ts):.2f} s)"
                f"  CPU s: sender {sender:.2f}, nats-server {nats_server:.2f}, artifact service {service_cpu:.2f}"
            )
        ratio = statistics.median(times["object_store.put"]) / statistics.median(times["jetlora datasets put"])
        print(f"jetlora's speed / object_store.put's: {ratio:.2f}x")
    finally:
        if service is not None:
            service.terminate()
            service.wait(30)
        server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
