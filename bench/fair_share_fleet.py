"""bench/fair_share.py's simulated fleet in a process of its own, apart from the submitters and the sampler.

In one event loop with them (bench/fleet_bench.py's sim_stack), the fleet's heartbeats, its replies to
assignments and its pauses waited behind 200 submissions at once and the sampler's decoding: a pause that landed
late, or a device seen free late, was counted against the scheduler. Here the fleet (bench/sim_fleet.py's, as is)
runs alone in its process, and says how late its own loop ran (a ticker every TICK_S: the largest overshoot, and
the time it was over LAG_S) and how long its pauses took to land (a pause asked to the `paused` state reported).
Clocks: time.monotonic() is the system's CLOCK_MONOTONIC, the same in every process on the machine, so the jobs'
ends the fleet reports compare with the bench's submission times.

The bench asks it on FIGURES_SUBJECT: b"count" answers {"done": n}; b"final" writes every figure to the file it
was started with (--out) and answers {"out": path}."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from bench.fleet_bench import leading_figures, pct, start_scheduler, until_all_alive  # noqa: E402
from bench.sim_fleet import Fleet, SimJob, dec_control  # noqa: E402
from schemas import names  # noqa: E402
from schemas.job_status import JobQuery, JobReply  # noqa: E402
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402

FIGURES_SUBJECT = "bench.fair_share.fleet"  # the bench's own: no jetlora service listens on it
TICK_S, LAG_S = 0.05, 0.1  # the fleet's loop ticker, and an overshoot that counts as the loop held


class TimedFleet(Fleet):
    """The simulated fleet, timing how long each pause takes to land (asked, to its `paused` state published)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.pause_asked: dict[str, float] = {}
        self.pause_took: list[float] = []

    async def on_control(self, msg):
        c = dec_control.decode(msg.data)
        if c.action == "pause" and c.job in self.running:
            self.pause_asked.setdefault(c.job, time.monotonic())
        await super().on_control(msg)

    async def _pause(self, job: SimJob) -> None:
        await super()._pause(job)
        asked = self.pause_asked.pop(job.a.job, None)
        if asked is not None:
            self.pause_took.append(time.monotonic() - asked)


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    """How late the fleet's loop wakes from a TICK_S sleep (a loop held by its own work, or by the machine)."""
    while not stop.is_set():
        asked = time.monotonic()
        await asyncio.sleep(TICK_S)
        lags.append(time.monotonic() - asked - TICK_S)


async def serve(args) -> None:
    nc = await nats.connect(args.nats)
    fleet = TimedFleet(nc, args.nodes, args.gpus, 0, args.interval)
    await fleet.subscribe()
    stop, lags = asyncio.Event(), []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def figures(msg) -> None:
        if msg.data == b"final":
            Path(args.out).write_text(json.dumps(final(fleet, lags)))
            await msg.respond(json.dumps({"out": args.out}).encode())
        else:
            await msg.respond(json.dumps({"done": len(fleet.done_at)}).encode())

    await nc.subscribe(FIGURES_SUBJECT, cb=figures)
    tasks = [asyncio.create_task(fleet.beat_forever()), asyncio.create_task(ticker(lags, stop))]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await nc.close()


def final(fleet: TimedFleet, lags: list[float]) -> dict:
    took = fleet.pause_took
    return {
        "done_at": fleet.done_at,
        "lost_s": fleet.lost_s,
        "work_s": fleet.work_s,
        "paused": fleet.paused,
        "running": list(fleet.running),
        "refused": fleet.refused,
        "loop_lag_max_s": max(lags, default=0.0),
        "loop_lag_p99_s": pct(lags, 99),
        "loop_held_s": sum(lag for lag in lags if lag > LAG_S),
        "pause_p50_s": pct(took, 50),
        "pause_p99_s": pct(took, 99),
    }


async def leftovers(client, unfinished: list[str], fleet) -> dict:
    """Where the jobs that did not finish in the run stand (by state, with an example's message each)."""
    by_state: dict[str, int] = {}
    examples: dict[str, str] = {}
    for job in unfinished[:500]:
        try:
            reply = await bus.request(client, names.GET_JOB, JobQuery(job), JobReply, timeout=5)
        except bus.RequestError as e:
            by_state["unanswered"] = by_state.get("unanswered", 0) + 1
            examples.setdefault("unanswered", str(e))
            continue
        key = f"{reply.job.state}{' (sim runs it)' if job in fleet.running else ''}"
        by_state[key] = by_state.get(key, 0) + 1
        examples.setdefault(key, f"{job} attempt {reply.job.attempt}: {reply.job.message[:200]}")
    return {"unfinished": len(unfinished), "left_states": by_state, "left_examples": examples}


class FleetProcess:
    """The bench's side: how many jobs the fleet saw end, and at the end every figure (as the attributes
    bench/fair_share_figures.py reads of a Fleet: done_at, lost_s, work_s, paused, running)."""

    def __init__(self, client, proc: subprocess.Popen) -> None:
        self.client, self.proc = client, proc

    async def done(self) -> int:
        try:
            msg = await self.client.request(FIGURES_SUBJECT, b"count", timeout=5)
        except Exception:  # the fleet busy: asked again next time
            return -1
        return int(json.loads(msg.data)["done"])

    async def final(self) -> SimpleNamespace:
        msg = await self.client.request(FIGURES_SUBJECT, b"final", timeout=30)
        out = json.loads(Path(json.loads(msg.data)["out"]).read_text())
        out["running"] = set(out["running"])
        return SimpleNamespace(**out)


@dataclass
class Stack:
    """One run's parts: the submitters' connection, the scheduler's process, the fleet's process."""

    client: nats.NATS
    sched: subprocess.Popen
    fleet: FleetProcess
    log: str

    def figures(self) -> dict:
        return leading_figures(Path(self.log).read_text())


@contextlib.asynccontextmanager
async def fleet_stack(flags: list[str], log: str, nodes: int, gpus: int, interval: float) -> AsyncIterator[Stack]:
    """A fresh store, the scheduler (`flags`, its log in `log`) and the simulated fleet, each in its own process,
    every node heard alive; torn down when the block ends."""
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(store_dir=Path(tmp) / "nats") as server:
        client = await nats.connect(server.url)
        await bus.ensure_resources(client)
        sched = start_scheduler(server.url, flags, log)
        command = [sys.executable, __file__, "--nats", server.url, "--nodes", str(nodes), "--gpus", str(gpus)]
        command += ["--interval", str(interval), "--out", str(Path(tmp) / "fleet.json")]
        proc = subprocess.Popen(command, cwd=ROOT)
        try:
            await until_all_alive(client, nodes)
            yield Stack(client, sched, FleetProcess(client, proc), log)
        finally:
            proc.terminate()
            sched.terminate()
            proc.wait(10)
            sched.wait(10)
            await client.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nats", required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    asyncio.run(serve(ap.parse_args()))
