"""A job's real trainers watched from outside, for tests of the one-trainer-at-a-time promise: each attempt's trainer
found by its pid file under the agents' work dirs, its CPU time read from /proc while it runs (so a trainer that
computes while it should wait shows as CPU moving), and the job's entry in the trainer lease bucket as stored."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from nats.js.errors import KeyNotFoundError

from schemas import names, trainer_lease
from services.procs import PID_FILE

TICK_S = 0.02  # how often each trainer's CPU time is read
TICKS_PER_S = 100  # /proc's clock ticks (USER_HZ)
COMPUTING_CPU_S = 2 / TICKS_PER_S  # a tick's CPU this large or more: it computed then (one that waits polls a file)


def cpu_s(pid: int) -> float | None:
    """The process's CPU time so far (user + system), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else (int(fields[11]) + int(fields[12])) / TICKS_PER_S


class Trainers:
    """The job's trainers on the agents' work dirs, by attempt: when each started, and when its CPU time moved."""

    def __init__(self, roots: list[Path], job: str) -> None:
        self.roots, self.job = roots, job
        self.pids: dict[int, int] = {}
        self.started: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.moved: dict[int, list[tuple[float, float]]] = {}  # attempt -> (wall time, CPU seconds since the last)

    def tick(self) -> None:
        now = time.time()
        for root in self.roots:
            for path in root.glob(f"jobs/{self.job}-*/{PID_FILE}"):
                attempt = int(path.parent.name.rsplit("-", 1)[1])
                try:
                    self.pids.setdefault(attempt, int(path.read_text().split()[0]))
                except (OSError, ValueError, IndexError):  # being written
                    continue
                self.started.setdefault(attempt, now)
        for attempt, pid in self.pids.items():
            cpu = cpu_s(pid)
            before = self.last.get(attempt)
            if cpu is not None:
                self.last[attempt] = cpu
                if before is not None and cpu > before:
                    self.moved.setdefault(attempt, []).append((now, cpu - before))

    async def watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.tick()
            await asyncio.sleep(TICK_S)

    def computed(self, attempt: int, since: float, until: float = float("inf")) -> float:
        """CPU seconds the attempt's trainer used between `since` and `until` (wall time)."""
        return sum(cpu for at, cpu in self.moved.get(attempt, []) if since < at <= until)

    def last_computed(self, attempt: int) -> float:
        """When the attempt's trainer last computed (wall time): a tick in which it used CPU as a step does."""
        return max((at for at, cpu in self.moved.get(attempt, []) if cpu >= COMPUTING_CPU_S), default=float("-inf"))


async def holder(nc, job: str) -> trainer_lease.Holder | None:
    """The job's entry in the trainer lease bucket as stored now; None when there is none."""
    kv = await nc.jetstream().key_value(names.TRAINER_LEASES_KV)
    try:
        entry = await kv.get(trainer_lease.key(job))
    except KeyNotFoundError:
        return None
    return trainer_lease.decode(entry.value or b"")
