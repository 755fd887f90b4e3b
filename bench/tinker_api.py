"""What the Tinker API costs on top of the training it drives: a forward_backward + optim_step of the same batch on
the tests' tiny model, through the official `tinker` client, the gateway, NATS, the agent and the session trainer
(`jetlora up` and `jetlora gateway` as processes), against the same two calls made in this process on a session's
own Session object (trainer/session.py: the same code the session trainer runs). The sides alternate in rounds of
`--steps`; reported: each side's p50 and p99 per step, and the API's overhead (API minus in-process) at p50 and
p99. Target on this machine: overhead p50 < 20 ms. Run by hand:

    .venv/bin/python bench/tinker_api.py [--rounds 6 --steps 20 --threads 1]

With --sessions 1,2,4: K sessions on one device as members of one session group's process against K session
processes of their own (bench/session_procs.py drives both as the agent does), and K tinker clients through the
whole stack (`jetlora up --co-train same-tenant`: the clients' sessions join one group on the agent's one device).
Each client sends a forward_backward and an optim_step and waits for both; sides alternate in rounds. Per K:
each side's time per step p50/p99 (the API's overhead: the API's p50 less the group process's), the aggregate
steps/s of the group against the separate processes (members' forward_backwards batched in one pass, and in turn
one call at a time: JETLORA_SESSION_BATCH=off), and peak resident memory: the group's process against the K
processes', and against the bound alone + (K-1) x one more member's own (measured from K = 1 to 2) + 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "deploy" / "demo"))

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
    tmp: Path, model_dir: Path, threads: int, co_train: str = "off"
) -> tuple[list[subprocess.Popen], str, int]:
    """`jetlora up` (scheduler, artifacts, an agent offering its CPU) and `jetlora gateway`; their NATS URL and the
    gateway's port."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp / "state"), "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    up = jetlora("up", "--port", "0", "--offer-cpu", "--node", "bench", "--co-train", co_train, env=env,
                 stdout=subprocess.PIPE, stderr=open(tmp / "up.log", "w"))  # fmt: skip
    url, deadline = "", time.monotonic() + 120
    while not url and time.monotonic() < deadline:
        line = up.stdout.readline()
        if line.startswith("NATS at "):
            url = line.split()[2]
    if not url:
        raise SystemExit(f"jetlora up did not come up; see {tmp / 'up.log'}")
    port = free_port()
    gateway = jetlora("gateway", "--nats", url, "--port", str(port), "--base-model", f"tiny={model_dir}",
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


def local_session(model_dir: Path, out: Path):
    import msgspec

    from schemas.events import TrainerSpec
    from schemas.jobs import JobRequest
    from trainer import events
    from trainer.session import Session

    events.mute()
    request = msgspec.convert(
        {"model": "tiny", "base_dir": str(model_dir), "train": {"method": "session"},
         "session": {"rank": 8, "seed": 0, "train_unembed": False}, "accelerator": "cpu"}, JobRequest)  # fmt: skip
    return Session(TrainerSpec(job="bench", attempt=1, request=request, out_dir=str(out)))


def timed_api(tc, types, batch, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result(), opt.result()
        times.append(time.perf_counter() - start)
    return times


def timed_local(session, fb_call, opt_call, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.call(fb_call), session.call(opt_call)
        times.append(time.perf_counter() - start)
    return times


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20, help="steps per side per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    ap.add_argument("--sessions", default="", help="K,K,...: sessions sharing a device (one process) against K apart")
    args = ap.parse_args()
    if args.sessions:
        from tinker_sharing import sharing

        sharing([int(k) for k in args.sessions.split(",")], args.rounds, args.steps, args.threads)
        return
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import torch
    from tinker import types

    from schemas.sessions import Datum, ForwardBackward, OptimStep
    from tinymodel import build

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build(tmp / "m", [f"{q} {a}" for q, a in PAIRS * 4], hidden=64, layers=2, vocab_size=400)
        procs, url, port = start_stack(tmp, model_dir, args.threads)
        try:
            sc, tc = api_client(port, api_key(url))
            batch = batch_of(tc.get_tokenizer(), types)
            local = local_session(model_dir, tmp / "local")
            fb_call = ForwardBackward(
                data=[Datum(tokens=d.model_input.to_ints(), inputs={k: v.tolist() for k, v in d.loss_fn_inputs.items()})
                      for d in batch], loss_fn="cross_entropy")  # fmt: skip
            opt_call = OptimStep(learning_rate=1e-3)
            timed_api(tc, types, batch, 3), timed_local(local, fb_call, opt_call, 3)  # warm-up
            api, inproc, overheads = [], [], []
            for r in range(args.rounds):
                sides = [("api", lambda: timed_api(tc, types, batch, args.steps)),
                         ("local", lambda: timed_local(local, fb_call, opt_call, args.steps))][:: 1 if r % 2 == 0 else -1]  # fmt: skip
                got = {name: run() for name, run in sides}
                api += got["api"]
                inproc += got["local"]
                overheads.append(statistics.median(got["api"]) - statistics.median(got["local"]))
                print(f"round {r + 1}: api p50 {pct(got['api'], 0.5):.1f} ms, in-process p50 "
                      f"{pct(got['local'], 0.5):.1f} ms", flush=True)  # fmt: skip
            sc.close("success")
        finally:
            stop_stack(procs)
    over = sorted(o * 1000 for o in overheads)
    print(
        f"forward_backward + optim_step, {len(PAIRS)} datums, {args.threads} thread(s), load "
        f"{os.getloadavg()[0]:.1f}: API p50 {pct(api, 0.5):.1f} ms p99 {pct(api, 0.99):.1f} ms; in-process p50 "
        f"{pct(inproc, 0.5):.1f} ms p99 {pct(inproc, 0.99):.1f} ms; overhead p50 {pct(api, 0.5) - pct(inproc, 0.5):.1f} "
        f"ms, p99 {pct(api, 0.99) - pct(inproc, 0.99):.1f} ms (per-round medians' difference {over[0]:.1f}-{over[-1]:.1f} ms)"
    )


if __name__ == "__main__":
    main()
