"""What the benches of the scheduler against a simulated fleet share (bench/control_plane.py, bench/fair_share.py):
the real scheduler in its own process on an embedded nats-server of its own, beside a simulated fleet
(bench/sim_fleet.py) heartbeating on the real subjects until the scheduler sees every node alive; what the
scheduler's log says of its leading when it ends; the process's CPU and memory; and the figures of several runs
printed as median (range)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from bench.sim_fleet import Fleet  # noqa: E402
from schemas import names  # noqa: E402
from schemas.nodes import NodeList  # noqa: E402
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402

ENDED = re.compile(
    r"leading ended: (\d+) placement passes \(longest ([\d.]+) ms, (\d+) past their budget\); (\d+) lease "
    r"renewals \((\d+) late, the latest (\d+) ms"
)
GC = re.compile(
    r"garbage collection while leading: (\d+) full collections \(the longest ([\d.]+) ms\), (\d+) of generation 1 "
    r"\(the longest ([\d.]+) ms\), (\d+) young \(the longest ([\d.]+) ms\)"
)
DEPOSED = ("Deposed", "stepping down", "stopped leading")  # what the scheduler logs when it stops leading


def pct(values: Sequence[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))] if values else float("nan")


def figure(values: Sequence[float], fmt: Callable[[float], str] = lambda v: f"{v:.0f}") -> str:
    """Several runs' values of one figure: median (min-max); '-' when no run has it."""
    if not values:
        return "-"
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def proc_stats(pid: int) -> tuple[float, float]:
    """CPU seconds (user+system) and peak RSS MiB of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    return cpu, hwm


def start_scheduler(url: str, flags: list[str], log: str) -> subprocess.Popen:
    """`jetlora scheduler` with `flags`, its log (stderr) in the file `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "scheduler", "--nats", url, *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
    )


def leading_figures(log: str) -> dict:
    """What the scheduler's closing lines say of its leading: placement passes, lease renewals, garbage
    collection, and how many times it stopped leading (deposed)."""
    out: dict = {"deposed": sum(log.count(word) for word in DEPOSED)}
    if m := ENDED.search(log):
        out.update(passes=int(m[1]), longest_pass_ms=float(m[2]), cut_short=int(m[3]))
        out.update(renewals=int(m[4]), renewals_late=int(m[5]), latest_renewal_ms=float(m[6]))
    if m := GC.search(log):
        out.update(gc_full=int(m[1]), gc_full_ms=float(m[2]), gc_young_ms=max(float(m[4]), float(m[6])))
    return out


async def until_all_alive(client, n_nodes: int) -> None:
    while True:
        try:
            nodes = await bus.request(client, names.LIST_NODES, b"{}", NodeList, timeout=5)
            if sum(n.alive for n in nodes.nodes) >= n_nodes:
                return
        except bus.RequestError:
            pass
        await asyncio.sleep(0.5)


@dataclass
class SimStack:
    """One run's parts: the fleet's connection (nc), the submitters' (client), the scheduler's process, the fleet."""

    nc: nats.NATS
    client: nats.NATS
    sched: subprocess.Popen
    fleet: Fleet
    log: str

    def figures(self) -> dict:
        """The scheduler's closing figures (leading_figures), once the run is over."""
        return leading_figures(Path(self.log).read_text())


@contextlib.asynccontextmanager
async def sim_stack(
    flags: list[str], log: str, nodes: int, gpus: int = 8, doomed: int = 0, interval: float = 1.0
) -> AsyncIterator[SimStack]:
    """A fresh store, the scheduler (`flags`, its log in `log`) and a fleet of `nodes` x `gpus` simulated devices
    that takes assignments and obeys controls, every node heard alive; torn down (the scheduler terminated, its
    closing lines written) when the block ends."""
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(store_dir=Path(tmp) / "nats") as server:
        nc = await nats.connect(server.url)
        client = await nats.connect(server.url)
        await bus.ensure_resources(nc)
        sched = start_scheduler(server.url, flags, log)
        fleet = Fleet(nc, nodes, gpus, doomed, interval)
        await fleet.subscribe()
        beats = asyncio.create_task(fleet.beat_forever())
        try:
            await until_all_alive(client, nodes)
            yield SimStack(nc, client, sched, fleet, log)
        finally:
            beats.cancel()
            sched.terminate()
            sched.wait(10)
            await nc.close()
            await client.close()


@contextlib.contextmanager
def profiled(pid: int, name: str, seconds: float = 60):
    """With BENCH_PROFILE=DIR, py-spy samples the process for the block (at most `seconds`) into DIR/<name>.txt
    (collapsed stacks: `py-spy` is not a dependency; pip install py-spy to use it)."""
    out = os.environ.get("BENCH_PROFILE")
    if not out:
        yield
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    beside = Path(sys.executable).with_name("py-spy")  # in the bench's own virtual environment, if there
    command = [
        str(beside) if beside.exists() else "py-spy",
        "record",
        "-p",
        str(pid),
        "-o",
        f"{out}/{name}.txt",
        "-f",
        "raw",
        "-r",
        "200",
    ]
    spy = subprocess.Popen([*command, "-d", str(int(seconds))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
