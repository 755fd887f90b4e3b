"""Serving with training beside it, on this machine's CPU: a real vLLM for CPU answers an open-loop Poisson stream
of completions (fixed prompt and output length) while a jetlora CPU job trains on the same cores. In alternating
rounds: serving alone; serving + training unmanaged (`--engine-yield off`); serving + training that yields
(`--engine-yield compute`); and training alone, for the share of time serving leaves idle. Prints time to first
token and total latency (p50, p99) and the job's steps per minute, with ratios against serving alone.
Run by hand:  JETLORA_VLLM_PYTHON=/path/to/vllm-venv/bin/python python bench/serving_aware.py [--rate 1 --seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from schemas import names  # noqa: E402
from schemas.jobs import Accepted, Error, SubmitReply  # noqa: E402
from schemas.job_status import JobQuery, JobReply  # noqa: E402
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402

PROMPT = "The capital of France is"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(where: Path) -> Path:
    """Head size 64 (hidden 256, 4 heads): one that vLLM's CPU attention supports."""
    sys.path.insert(0, str(ROOT / "deploy" / "demo"))
    import tinymodel

    texts = [
        json.loads(line)["q"] + " " + json.loads(line)["a"]
        for line in (ROOT / "deploy" / "demo" / "qa.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return tinymodel.build(where, texts, hidden=256, layers=4, heads=4, kv_heads=4, vocab_size=512)


def start_vllm(python: str, model: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    return subprocess.Popen(
        [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--enable-server-load-tracking",
        ],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


def wait_http(url: str, deadline_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the engine exited ({proc.returncode}) before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise SystemExit(f"{url} did not answer in {deadline_s:.0f}s")


def one_request(url: str, tokens: int) -> tuple[float, float]:
    """(time to first token, total), streamed."""
    body = json.dumps(
        {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data:") and first is None and b"[DONE]" not in line:
                first = time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0


async def load(
    url: str, rate: float, seconds: float, tokens: int, seed: int
) -> tuple[list[tuple[float, float]], float]:
    """An open-loop Poisson stream; returns each request's latencies and the share of the window with none in flight."""
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks, spans = [], []

    async def send(at: float):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        began = time.perf_counter() - start
        ttft, total = await asyncio.to_thread(one_request, url, tokens)
        spans.append((began, began + total))
        return ttft, total

    at = rng.expovariate(rate)
    while at < seconds:
        tasks.append(asyncio.create_task(send(at)))
        at += rng.expovariate(rate)
    results = await asyncio.gather(*tasks)
    busy, end = 0.0, 0.0
    for a, b in sorted(spans):  # the union of the requests' spans
        if b > end:
            busy += b - max(a, end)
            end = b
    window = max(seconds, end)
    return list(results), 1.0 - busy / window


class Fleet:
    """jetlora in-process (scheduler, artifacts) on an embedded nats-server; the agent as a process of its own."""

    def __init__(self, tmp: Path, engine_url: str) -> None:
        self.tmp, self.engine_url = tmp, engine_url
        self.server = EmbeddedNats(store_dir=tmp / "nats").start()
        self.agent: subprocess.Popen | None = None

    async def start(self) -> None:
        from services.artifacts.service import ArtifactService
        from services.scheduler.service import Scheduler, SchedulerConfig

        self.nc = await nats.connect(self.server.url)
        await bus.ensure_resources(self.nc)
        self.stop = asyncio.Event()
        self.sched = Scheduler(await nats.connect(self.server.url), SchedulerConfig(heartbeat_interval=0.5))
        self.tasks = [
            asyncio.create_task(self.sched.run(self.stop)),
            asyncio.create_task(ArtifactService(await nats.connect(self.server.url)).run(self.stop)),
        ]
        await asyncio.wait_for(self.sched.leading.wait(), 30)

    def start_agent(self, policy: str) -> None:
        self.stop_agent()
        self.agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "agent",
                "--nats",
                self.server.url,
                "--node",
                "box",
                "--offer-cpu",
                "--work-dir",
                str(self.tmp / "agent"),
                "--heartbeat-interval",
                "0.5",
                "--engine",
                f"vllm={self.engine_url}",
                "--engine-model",
                "tiny",
                "--engine-yield",
                policy,
            ],
            cwd=ROOT,
            stdout=(self.tmp / "agent.log").open("ab"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def stop_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            self.agent.wait(60)
        self.agent = None

    async def job(self, model: Path) -> str:
        data = [json.loads(line) for line in (ROOT / "deploy" / "demo" / "qa.jsonl").read_text().splitlines() if line]
        deadline = time.monotonic() + 60
        while True:  # until the agent's heartbeats offer its CPU
            reply = await bus.request(
                self.nc,
                names.SUBMIT,
                {  # type: ignore[arg-type]
                    "model": "tiny",
                    "base_dir": str(model),
                    "accelerator": "cpu",
                    "data": data[:64],
                    "train": {"max_steps": 1_000_000, "batch_size": 4, "max_seq_length": 128, "logging_steps": 1},
                },
                SubmitReply,
            )
            if isinstance(reply, Accepted):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the job was not accepted: {reply}")
            await asyncio.sleep(0.5)
        while (await self.status(reply.job)).step < 3:  # past the start-up
            await asyncio.sleep(0.2)
        return reply.job

    async def status(self, job: str):
        return (await bus.request(self.nc, names.GET_JOB, JobQuery(job), JobReply)).job

    async def final_message(self, job: str) -> str:
        deadline = time.monotonic() + 60
        while (status := await self.status(job)).state not in ("cancelled", "failed", "succeeded"):
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job} did not end within 60 s of its cancel: {status.state}")
            await asyncio.sleep(0.2)
        return status.message

    async def cancel(self, job: str) -> None:
        await bus.request(self.nc, names.CANCEL, JobQuery(job), JobReply | Error)  # type: ignore[arg-type]

    async def close(self) -> None:
        self.stop_agent()
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.server.stop()


async def run_case(fleet: Fleet, model: Path, case: str, args, seed: int) -> dict:
    job = None
    if case != "alone":
        fleet.start_agent(
            {
                "unmanaged": "off,poll=0.1",
                "yielding": f"compute,poll={args.poll},holdoff={args.holdoff},nice={args.nice}",
                "train alone": "off,poll=0.1",
            }[case]
        )
        job = await fleet.job(model)
    step0, t0 = (await fleet.status(job)).step if job else 0, time.monotonic()
    if case == "train alone":
        await asyncio.sleep(args.seconds)
        results, idle = [], 1.0
    else:
        results, idle = await load(fleet.engine_url, args.rate, args.seconds, args.tokens, seed)
    minutes = (time.monotonic() - t0) / 60
    steps = ((await fleet.status(job)).step - step0) / minutes if job else 0.0
    stopped = 0.0
    if job:
        await fleet.cancel(job)
        stopped = yielded_s(await fleet.final_message(job)) / (minutes * 60)
        fleet.stop_agent()
    return {
        "ttft": [r[0] for r in results],
        "total": [r[1] for r in results],
        "steps_min": steps,
        "idle": idle,
        "stopped": stopped,
    }


def yielded_s(message: str) -> float:
    """The job's time stopped for serving, from its final message (`...; yielded 12.3s to serving`)."""
    found = re.search(r"yielded ([0-9.]+)s to serving", message)
    return float(found.group(1)) if found else 0.0


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (one it serves alone)")
    ap.add_argument("--seconds", type=float, default=30.0, help="per case and round")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--holdoff", type=float, default=0.25, help="idle seconds before training goes on")
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between reads of the engine's metrics")
    ap.add_argument("--nice", type=int, default=5, help="the yielding trainer's CPU niceness")
    args = ap.parse_args()
    python = os.environ.get("JETLORA_VLLM_PYTHON")
    if not python:
        raise SystemExit("set JETLORA_VLLM_PYTHON to the python of a venv with vllm-cpu (see ../shared/FACTS.md)")
    tmp = Path(tempfile.mkdtemp(prefix="serving-aware-"))
    model = build_model(tmp / "model")
    port = free_port()
    engine = start_vllm(python, model, port, tmp / "vllm.log")
    url = f"http://127.0.0.1:{port}"
    fleet = Fleet(tmp, url)
    try:
        wait_http(f"{url}/v1/models", 600, engine)
        await asyncio.to_thread(one_request, url, args.tokens)  # warm
        await fleet.start()
        cases = ["alone", "unmanaged", "yielding", "train alone"]
        out: dict[str, list[dict]] = {c: [] for c in cases}
        for r in range(args.rounds):
            for case in cases if r % 2 == 0 else list(reversed(cases)):
                out[case].append(await run_case(fleet, model, case, args, seed=r))
                print(f"  round {r + 1}: {case} done", flush=True)
    finally:
        await fleet.close()
        engine.terminate()
        engine.wait(60)
    report(out)


def report(out: dict[str, list[dict]]) -> None:
    rows = {}
    for case, rounds in out.items():
        ttft = [x for r in rounds for x in r["ttft"]]
        total = [x for r in rounds for x in r["total"]]
        rows[case] = dict(
            ttft50=pct(ttft, 0.5),
            ttft99=pct(ttft, 0.99),
            tot50=pct(total, 0.5),
            tot99=pct(total, 0.99),
            steps=statistics.median(r["steps_min"] for r in rounds),
            idle=statistics.median(r["idle"] for r in rounds),
            n=len(total),
            stopped=statistics.median(r["stopped"] for r in rounds),
        )
    base = rows["alone"]
    print(
        f"{'case':12}{'requests':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'total p50':>11}{'total p99':>11}"
        f"{'p99 x alone':>12}{'steps/min':>11}   (latencies in ms)"
    )
    for case, f in rows.items():
        ratio = f["tot99"] / base["tot99"] if f["n"] else float("nan")
        print(
            f"{case:12}{f['n']:>9}{f['ttft50'] * 1e3:>10.0f}{f['ttft99'] * 1e3:>10.0f}{f['tot50'] * 1e3:>11.0f}"
            f"{f['tot99'] * 1e3:>11.0f}{ratio:>12.2f}{f['steps']:>11.1f}"
        )
    allowed = rows["train alone"]["steps"] * base["idle"]
    print(
        f"serving leaves {base['idle']:.0%} of the time idle: yielding trained {rows['yielding']['steps']:.1f} "
        f"steps/min, {rows['yielding']['steps'] / allowed:.2f}x of the {allowed:.1f} that share allows "
        "(training alone x idle share)"
    )
    running = 1 - rows["yielding"]["stopped"]
    print(
        f"the yielding job was stopped {rows['yielding']['stopped']:.0%} of the time; while it ran "
        f"it made {rows['yielding']['steps'] / max(running, 1e-9):.1f} steps/min, "
        f"{rows['yielding']['steps'] / max(running, 1e-9) / rows['train alone']['steps']:.2f}x training alone"
    )


if __name__ == "__main__":
    asyncio.run(main())
