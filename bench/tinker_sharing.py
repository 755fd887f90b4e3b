"""`bench/tinker_api.py --sessions 1,2,4`: Tinker sessions sharing a device. For each K: K sessions as members of
one session group's process (members' forward_backwards batched in one pass, and with JETLORA_SESSION_BATCH=off
one call at a time in turn), K session processes of their own, and K tinker clients through the whole stack
(their sessions members of one group on the agent's one device); sides alternate in rounds of `steps` steps. Each
process, the group's and each of the K, runs `threads` torch threads (the K processes spread over the cores)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from session_procs import Sessions
from guarantees import Guarantees
from tinker_stack import PAIRS, api_client, api_key, batch_of, pct, settle_gc, start_stack, stop_stack, timed_api

SIDES = ("api", "group", "group-in-turn", "separate")


def sharing(ks: list[int], rounds: int, steps: int, threads: int, targets: tuple[float, float]) -> int:
    """Every K's figures; the exit status (non-zero when a promise broke: the memory bound or an overhead target)."""
    promises = Guarantees()
    from tinker import types

    from schemas.sessions import Datum, ForwardBackward, OptimStep
    from tinymodel import build

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build(tmp / "m", [f"{q} {a}" for q, a in PAIRS * 4], hidden=64, layers=2, vocab_size=400)
        procs, url, port = start_stack(tmp, model_dir, threads, co_train="same-tenant")
        try:
            key = api_key(url)
            clients = [api_client(port, key, seed=i) for i in range(max(ks))]
            settle_gc()
            batch = batch_of(clients[0][1].get_tokenizer(), types)
            fb = ForwardBackward(
                data=[Datum(tokens=d.model_input.to_ints(), inputs={k: v.tolist() for k, v in d.loss_fn_inputs.items()})
                      for d in batch], loss_fn="cross_entropy")  # fmt: skip
            calls = (fb, OptimStep(learning_rate=1e-3))
            peaks: dict[int, float] = {}
            for k in ks:
                peaks[k] = one_k(k, rounds, steps, threads, [tc for _, tc in clients[:k]], types, batch, calls,
                                 model_dir, tmp / f"k{k}", peaks, promises, targets)  # fmt: skip
            for sc, _ in clients:
                sc.close("success")
        finally:
            stop_stack(procs)
    return promises.verdict()


def one_k(k, rounds, steps, threads, tcs, types, batch, calls, model_dir, out, peaks, promises, targets) -> float:
    """Figures for K sessions; the group process's peak resident MiB."""
    out.mkdir()
    shared = threads  # as many torch threads as each of the K processes (more only slowed this tiny model's group)
    direct = {
        "group": Sessions(k, True, model_dir, out / "group", shared),
        "group-in-turn": Sessions(k, True, model_dir, out / "turns", shared, batch=False),
        "separate": Sessions(k, False, model_dir, out / "separate", threads),
    }
    pool = ThreadPoolExecutor(k)

    def api_round() -> list[float]:
        return [t for times in pool.map(lambda tc: timed_api(tc, types, batch, steps), tcs) for t in times]

    def direct_round(side: Sessions) -> list[float]:
        return [t for _ in range(steps) for t in side.step(calls)]

    runs = {"api": api_round, **{name: (lambda s=s: direct_round(s)) for name, s in direct.items()}}
    for run in runs.values():
        run()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    rates: dict[str, list[float]] = {name: [] for name in SIDES}
    for r in range(rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for name in order:
            start = time.perf_counter()
            got = runs[name]()
            rates[name].append(k * steps / (time.perf_counter() - start))
            times[name] += got
    peak = {name: s.peak_mib() for name, s in direct.items()}
    for s in direct.values():
        s.close()
    pool.shutdown()
    report(k, times, rates, peak, peaks, promises, targets)
    return peak["group"]


def report(k, times, rates, peak, peaks, promises: Guarantees, targets: tuple[float, float]) -> None:
    def ratio(a: str, b: str) -> str:
        rs = sorted(x / y for x, y in zip(rates[a], rates[b]))
        return f"{statistics.median(rs):.2f}x ({rs[0]:.2f}-{rs[-1]:.2f})"

    print(f"\nK = {k} sessions on one device, load {os.getloadavg()[0]:.1f}:")
    for name in SIDES:
        print(f"  {name:14} per step p50 {pct(times[name], 0.5):6.1f} ms  p99 {pct(times[name], 0.99):6.1f} ms  "
              f"{statistics.median(rates[name]):6.1f} steps/s")  # fmt: skip
    over50 = pct(times["api"], 0.5) - pct(times["group"], 0.5)
    over99 = pct(times["api"], 0.99) - pct(times["group"], 0.99)
    print(f"  API overhead over the group process: p50 {over50:.1f} ms, p99 {over99:.1f} ms")
    promises.check(over50 < targets[0], f"K = {k}: API overhead p50 {over50:.1f} ms under {targets[0]:g} ms")
    promises.check(over99 < targets[1], f"K = {k}: API overhead p99 {over99:.1f} ms under {targets[1]:g} ms")
    print(f"  throughput, group / separate processes: batched {ratio('group', 'separate')}, in turn "
          f"{ratio('group-in-turn', 'separate')}; batched / in turn {ratio('group', 'group-in-turn')}")  # fmt: skip
    line = f"  peak resident: group process {peak['group']:.0f} MiB, {k} processes {peak['separate']:.0f} MiB"
    if 1 in peaks and 2 in peaks and k > 2:
        bound = (peaks[1] + (k - 1) * (peaks[2] - peaks[1])) * 1.1
        line += f"; bound (alone + {k - 1} x one member's own + 10%) {bound:.0f} MiB"
        promises.check(peak["group"] <= bound, f"K = {k}: group peak {peak['group']:.0f} MiB within {bound:.0f} MiB")
    print(line, flush=True)
