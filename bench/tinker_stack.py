"""The stack the Tinker benches drive: `jetlora up` and `jetlora gateway` as processes, a tenant's key, the official
client's training client, the batch both benches send and the timing of its steps through the API. Shared by
bench/tinker_api.py and bench/tinker_sharing.py, so the second needs nothing of the first (tinker_api.py runs
tinker_sharing.py's comparison for --sessions: one direction, no import circle)."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PAIRS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Which planet is the largest?", "Jupiter is the largest planet."),
]


def jetlora(*args: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env, text=True, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stack(
    tmp: Path, model_dir: Path, threads: int, co_train: str = "off", node: str = "bench", base: str = "tiny"
) -> tuple[list[subprocess.Popen], str, int]:
    """`jetlora up` (scheduler, artifacts, an agent offering its CPU) and `jetlora gateway`; their NATS URL and the
    gateway's port."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp / "state"), "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    up = jetlora("up", "--port", "0", "--offer-cpu", "--node", node, "--co-train", co_train, env=env,
                 stdout=subprocess.PIPE, stderr=open(tmp / "up.log", "w"))  # fmt: skip
    url, deadline = "", time.monotonic() + 120
    while not url and time.monotonic() < deadline:
        line = up.stdout.readline()
        if line.startswith("NATS at "):
            url = line.split()[2]
    if not url:
        raise SystemExit(f"jetlora up did not come up; see {tmp / 'up.log'}")
    port = free_port()
    gateway = jetlora("gateway", "--nats", url, "--port", str(port), "--base-model", f"{base}={model_dir}",
                      "--accelerator", "cpu", env=env, stderr=open(tmp / "gateway.log", "w"))  # fmt: skip
    return [up, gateway], url, port


def stop_stack(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every process start_stack started, then wait for each."""
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=30)


def api_key(url: str) -> str:
    out = subprocess.run([sys.executable, "-m", "services.cli", "keys", "create", "--tenant", "bench", "--nats", url,
                          "--json"], cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    return "tml-" + json.loads(out.stdout)["key"]


def batch_of(tokenizer, types) -> list:
    out = []
    for q, a in PAIRS:
        prompt, answer = tokenizer.encode(q + " "), tokenizer.encode(a, add_special_tokens=False)
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))  # fmt: skip
    return out


def api_client(port: int, key: str, seed: int = 0):
    import tinker

    deadline = time.monotonic() + 120
    while True:
        try:
            sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key)
            return sc, sc.create_lora_training_client(
                base_model="tiny", rank=8, seed=seed, train_unembed=False
            ).result()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def timed_api(tc, types, batch, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result(), opt.result()
        times.append(time.perf_counter() - start)
    return times


def settle_gc() -> None:
    """What the bench holds from here on (torch, the model, the clients) moved out of the collector's reach: a full
    collection walked all of it, 40-160 ms in the bench's own process with 4 clients (gc.callbacks), which was
    the p99 of every side that ran then, however fast the stack answered."""
    gc.collect()
    gc.freeze()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000
