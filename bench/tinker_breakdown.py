"""Where a Tinker step's API overhead goes (#64): one stack (`jetlora up` + `jetlora gateway`, bench/tinker_stack.py)
and each piece of a call's path timed alone, sides interleaved, medians over `--n` tries:

- step: forward_backward + optim_step through the official client (as bench/tinker_api.py), and the same two
  calls on an in-process Session (the trainer's own compute);
- HTTP: a request the gateway answers from memory, through the official client (its thread hop, httpx, pydantic)
  and through a bare httpx client;
- NATS: a request/reply round trip, a KV create and a KV put on a scratch bucket configured as the futures' one;
- the agent and the trainer: a Ping, and the step's two calls, sent as the gateway sends them
  (names.node(node).session) to the session's agent, which hands them to the trainer's stdin and answers its line.

Run by hand: `.venv/bin/python bench/tinker_breakdown.py [--n 60 --threads 1]`."""

from __future__ import annotations

import argparse
import asyncio
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

from tinker_api import local_session  # noqa: E402
from tinker_stack import PAIRS, api_client, api_key, batch_of, start_stack, stop_stack, timed_api  # noqa: E402


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


async def bus_side(url: str, tenant: str, model_id: str, fb, opt, n: int) -> dict[str, list[float]]:
    """NATS floors and the agent's hop, timed from this process as the gateway would make them."""
    import nats
    from nats.js.api import KeyValueConfig, StorageType

    from schemas import names
    from schemas.sessions import Ping, SessionReply, SessionRequest
    from schemas.tinker_store import ModelRecord, model_key
    from services import bus

    nc = await nats.connect(url)
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket="probe_breakdown", history=1, storage=StorageType.FILE))

    async def echo(msg) -> None:
        await msg.respond(b"ok")

    sub = await nc.subscribe("probe.echo", cb=echo)
    main = await js.key_value(names.TINKER_KV)
    model = msgspec_decode(ModelRecord, (await main.get(model_key(tenant, model_id))).value)
    subject = names.node("bench").session
    out: dict[str, list[float]] = {k: [] for k in ("nats request", "kv create", "kv put", "agent ping", "agent fb+opt")}
    payload = b"x" * 600  # about a future's record
    for i in range(n):
        t = time.perf_counter()
        await nc.request("probe.echo", b"hi", timeout=2)
        out["nats request"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await kv.create(f"c.{i}.{time.monotonic_ns()}", payload)
        out["kv create"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await kv.put(f"p.{i}", payload)
        out["kv put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await bus.request(nc, subject, SessionRequest(job=model.job, tenant=tenant, call=Ping()), SessionReply)
        out["agent ping"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for call in (fb, opt):
            await bus.request(nc, subject, SessionRequest(job=model.job, tenant=tenant, call=call), SessionReply)
        out["agent fb+opt"].append(time.perf_counter() - t)
    await sub.unsubscribe()
    await js.delete_key_value("probe_breakdown")
    await nc.close()
    return out


def msgspec_decode(kind, raw: bytes):
    import msgspec

    return msgspec.json.decode(raw, type=kind)


def http_side(sc, port: int, key: str, n: int) -> dict[str, list[float]]:
    import httpx

    out: dict[str, list[float]] = {"http official client": [], "http bare": []}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"X-API-Key": key}) as bare:
        for _ in range(n):
            t = time.perf_counter()
            sc.get_server_capabilities()
            out["http official client"].append(time.perf_counter() - t)
            t = time.perf_counter()
            bare.get("/api/v1/get_server_capabilities").raise_for_status()
            out["http bare"].append(time.perf_counter() - t)
    return out


def cpu_by_process(roots: list[int]) -> dict[str, float]:
    """CPU seconds so far of every process under `roots` and of this one, by what each runs."""
    import psutil

    out: dict[str, float] = {}
    procs = [psutil.Process()]
    for pid in roots:
        root = psutil.Process(pid)
        procs += [root, *root.children(recursive=True)]
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            t = p.cpu_times()
        except psutil.Error:
            continue
        name = ("client (this bench)" if p.pid == os.getpid() else "nats-server" if "nats-server" in cmd
                else "gateway" if " gateway " in cmd else "trainer" if "-m trainer" in cmd
                else "agent" if " agent" in cmd else "up (scheduler, artifacts, agent...)")  # fmt: skip
        out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60, help="tries of each piece")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
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
            key = api_key(url)
            sc, tc = api_client(port, key)
            batch = batch_of(tc.get_tokenizer(), types)
            local = local_session(model_dir, tmp / "local")
            fb = ForwardBackward(
                data=[Datum(tokens=d.model_input.to_ints(), inputs={k: v.tolist() for k, v in d.loss_fn_inputs.items()})
                      for d in batch], loss_fn="cross_entropy")  # fmt: skip
            opt = OptimStep(learning_rate=1e-3)
            timed_api(tc, types, batch, 5)
            before, t0 = cpu_by_process([p.pid for p in procs]), time.perf_counter()
            timed_api(tc, types, batch, args.n)
            after, wall = cpu_by_process([p.pid for p in procs]), time.perf_counter() - t0
            cpu = {k: (after[k] - before.get(k, 0.0)) / args.n * 1000 for k in after}
            got: dict[str, list[float]] = {"api step": [], "local step": []}
            for _ in range(3):  # interleaved: each piece sees the same machine
                got["api step"] += timed_api(tc, types, batch, args.n // 3)
                for _ in range(args.n // 3):
                    t = time.perf_counter()
                    local.call(fb), local.call(opt)
                    got["local step"].append(time.perf_counter() - t)
                for name, xs in http_side(sc, port, key, args.n // 3).items():
                    got.setdefault(name, []).extend(xs)
                bus = asyncio.run(bus_side(url, "bench", tc.model_id, fb, opt, args.n // 3))
                for name, xs in bus.items():
                    got.setdefault(name, []).extend(xs)
            sc.close("success")
        finally:
            stop_stack(procs)
    print(f"CPU per API step (ms), wall {wall / args.n * 1000:.2f} ms a step:")
    for name, ms in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"  {name:36s} {ms:6.2f}")
    for name, xs in got.items():
        print(f"{name:24s} p50 {med(xs):7.2f} ms  p90 {sorted(xs)[int(0.9 * len(xs))] * 1000:7.2f} ms")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
