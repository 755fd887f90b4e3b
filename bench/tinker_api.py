"""What the Tinker API costs on top of the training it drives: a forward_backward + optim_step of the same batch on
the tests' tiny model, through the official `tinker` client, the gateway, NATS, the agent and the session trainer
(`jetlora up` and `jetlora gateway` as processes), against the same two calls made in this process on a session's
own Session object (trainer/session/serve.py: the same code the session trainer runs). The sides alternate in rounds of
`--steps`; reported: each side's p50 and p99 per step, and the API's overhead (API minus in-process) at p50 and
p99. Target (--target-ms): overhead p50 < 5 ms. Where the overhead goes: bench/tinker_breakdown.py. Run by hand:

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
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "deploy" / "demo"))
sys.path.insert(0, str(ROOT / "bench"))

from guarantees import Guarantees  # noqa: E402
from tinker_stack import (  # noqa: E402
    PAIRS,
    api_client,
    api_key,
    batch_of,
    pct,
    settle_gc,
    start_stack,
    stop_stack,
    timed_api,
)


def local_session(model_dir: Path, out: Path):
    import msgspec

    from schemas.events import TrainerSpec
    from schemas.jobs import JobRequest
    from trainer import events
    from trainer.session.serve import Session

    events.mute()
    request = msgspec.convert(
        {"model": "tiny", "base_dir": str(model_dir), "train": {"method": "session"},
         "session": {"rank": 8, "seed": 0, "train_unembed": False}, "accelerator": "cpu"}, JobRequest)  # fmt: skip
    return Session(TrainerSpec(job="bench", attempt=1, request=request, out_dir=str(out)))


def timed_local(session, fb_call, opt_call, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.call(fb_call), session.call(opt_call)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20, help="steps per side per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    ap.add_argument("--sessions", default="", help="K,K,...: sessions sharing a device (one process) against K apart")
    ap.add_argument("--target-ms", type=float, default=5.0, help="the promised API overhead p50, one session alone")
    ap.add_argument("--shared-target-ms", type=float, nargs=2, default=(15.0, 40.0), metavar=("P50", "P99"),
                    help="the promised API overhead over the group process with --sessions, at every K")  # fmt: skip
    args = ap.parse_args()
    if args.sessions:
        from tinker_sharing import sharing

        ks = [int(k) for k in args.sessions.split(",")]
        sys.exit(sharing(ks, args.rounds, args.steps, args.threads, tuple(args.shared_target_ms)))
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
            settle_gc()
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
    promises = Guarantees()
    overhead = pct(api, 0.5) - pct(inproc, 0.5)
    promises.check(overhead < args.target_ms, f"API overhead p50 {overhead:.1f} ms under {args.target_ms:g} ms")
    sys.exit(promises.verdict())


if __name__ == "__main__":
    main()
