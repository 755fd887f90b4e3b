"""The tinker-cookbook (0.6.1) run unmodified against a jetlora stack, as a user moving off hosted Tinker would
(#63): `jetlora up` (an agent offering its CPU) and `jetlora gateway` serving a tiny local model named by its
directory, a tenant's key, then bench/cookbook_loops.py in the cookbook's own venv: sl_basic's supervised loop with
an evaluator, saves and rolling saves, its resume, math_rl's RL loop (stable_reinforce, its default) and
rl_basic's loss (importance_sampling), sampling a finished run's sampler path through the cookbook's completer, and
weights.download of a state. Last, the gateway's exit on SIGTERM after its NATS is gone is timed.

    cpulock shared .venv/bin/python bench/cookbook_run.py --cookbook-python /tmp/cookbook-venv/bin/python

The cookbook's venv: `python -m venv V; V/bin/pip install tinker==0.38.0; V/bin/pip install --no-deps
tinker-cookbook==0.6.1`, then its dependencies by name (its tml-renderers pin is not on the index and only its
Inkling/Kimi recipes import it): aiohttp anyio blobfile chz cloudpickle datasets huggingface-hub numpy pillow
pydantic pyrage rich safetensors termcolor tiktoken torch tqdm transformers sympy pylatexenc math-verify.
Exits 1 when a loop failed or the gateway took longer than its promise to exit."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "demo"))

from tinker_stack import ROOT, api_key, start_stack  # noqa: E402

GATEWAY_EXIT_S = 10.0  # a gateway whose NATS is gone exits within this of SIGTERM


def gateway_exit_s(up: subprocess.Popen, gateway: subprocess.Popen) -> float:
    """NATS (jetlora up's) stopped first, then SIGTERM to the gateway: seconds until it exited."""
    up.terminate()
    up.wait(60)
    start = time.monotonic()
    gateway.terminate()
    try:
        gateway.wait(60)
    except subprocess.TimeoutExpired:
        gateway.kill()
    return time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cookbook-python", default="/tmp/cookbook-venv/bin/python")
    p.add_argument("--only", default="", help="loops to run (bench/cookbook_loops.py's names), comma-separated")
    p.add_argument("--keep", default="", help="a directory to keep logs and the cookbook's runs in")
    args = p.parse_args()
    from tinymodel import build

    tmp = Path(args.keep or tempfile.mkdtemp(prefix="jetlora-cookbook-"))
    tmp.mkdir(parents=True, exist_ok=True)
    texts = ["User: What is 4 + 5?\n\nAssistant: 9", "User: What is the capital of France?\n\nAssistant: Paris."]
    model_dir = build(tmp / "tiny", texts * 8, hidden=64, layers=2, vocab_size=512)
    (up, gateway), url, port = start_stack(tmp, model_dir, 1, "same-tenant", "cookbook", str(model_dir))
    env = {**os.environ, "TINKER_API_KEY": api_key(url), "OMP_NUM_THREADS": "1", "TINKER_TELEMETRY": "0"}
    env.pop("PYTHONPATH", None)
    command = [args.cookbook_python, str(ROOT / "bench" / "cookbook_loops.py"), "--base-url",
               f"http://127.0.0.1:{port}", "--model", str(model_dir), "--out", str(tmp / "runs")]  # fmt: skip
    if args.only:
        command += ["--only", args.only]
    try:
        loops = subprocess.run(command, env=env, text=True, capture_output=True, timeout=1800)
    finally:
        exit_s = gateway_exit_s(up, gateway)
    (tmp / "loops.log").write_text(loops.stdout + loops.stderr)
    report = next((json.loads(line[7:]) for line in loops.stdout.splitlines() if line.startswith("REPORT ")), [])
    for row in report:
        print(f"{row['loop']:10s} {'ok' if row['ok'] else 'FAILED'} {row['s']:7.1f}s "
              f"{json.dumps(row.get('seen') or row.get('error'))[:600]}")  # fmt: skip
    print(f"gateway exit after SIGTERM, its NATS gone: {exit_s:.1f}s (promise < {GATEWAY_EXIT_S:.0f}s)")
    print(f"logs: {tmp}")
    failed = not report or not all(r["ok"] for r in report) or exit_s >= GATEWAY_EXIT_S
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
