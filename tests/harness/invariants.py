"""What must hold whatever faults are injected, checked from outside the services:

- every accepted job reaches exactly one terminal state, and no terminal state is ever replaced;
- no device is held by two active jobs at once (by the statuses the store holds), unless both train in one
  co-training group there;
- no job stays `assigned` longer than a bound;
- never more than one trainer of a job computing at once, beyond a bounded overlap (the stand-in trainer's step
  log, HOLD_LOG, says which attempt computed which step when);
- nothing is left behind: every job the store holds ends (no orphan queued or active forever).

StatusWatch follows every status write of the jobs bucket as it is stored (an ordered consumer)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path

import msgspec
from nats.js.api import DeliverPolicy

from schemas import names
from schemas.job_status import ACTIVE_STATES, TERMINAL_STATES, JobStatus
from schemas.job_records import JOBS, STATUS

_status = msgspec.json.Decoder(JobStatus)


class StatusWatch:
    """Every status write in store order: terminal states replaced, devices held twice, assignments too long."""

    def __init__(self, js, assigned_bound_s: float = 15.0) -> None:
        self.js, self.assigned_bound_s = js, assigned_bound_s
        self.last: dict[str, JobStatus] = {}
        self.assigned_since: dict[str, float] = {}
        self.holders: dict[tuple[str, int], dict[str, str | None]] = defaultdict(dict)  # slot -> job -> its group
        self.violations: list[str] = []
        self.placements: dict[str, list[tuple[int, str, float]]] = defaultdict(list)  # job -> (attempt, node, when)
        self.writes = 0
        self._sub = None

    async def start(self) -> "StatusWatch":
        self._sub = await self.js.subscribe(
            JOBS.prefix + STATUS + ".>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL, cb=self._on
        )
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        self.check_assigned()

    async def _on(self, msg) -> None:
        if not msg.data:
            return
        job = msg.subject.removeprefix(JOBS.prefix + STATUS + ".")
        status = _status.decode(msg.data)
        self.writes += 1
        before = self.last.get(job)
        if before is not None and before.state in TERMINAL_STATES and status.state != before.state:
            self.violations.append(f"job {job}: {before.state} was replaced by {status.state} ({status.message})")
        self.last[job] = status
        for held in self.holders.values():
            held.pop(job, None)
        if status.state in ACTIVE_STATES and status.node is not None and status.device is not None:
            for d in status.devices or [status.device]:
                held = self.holders[(status.node, d)]
                for other, group in held.items():
                    if self.last[other].state in ACTIVE_STATES and (group is None or group != status.group):
                        self.violations.append(f"{status.node} device {d} held by jobs {other} and {job} at once")
                held[job] = status.group
        if status.state == "assigned":
            self.assigned_since.setdefault(job, time.monotonic())
            placed = self.placements[job]
            if status.node is not None and (not placed or placed[-1][0] != status.attempt):
                placed.append((status.attempt, status.node, status.updated))
        else:
            self.assigned_since.pop(job, None)

    def check_assigned(self) -> None:
        now = time.monotonic()
        for job, since in self.assigned_since.items():
            if now - since > self.assigned_bound_s:
                self.violations.append(f"job {job} has been assigned for {now - since:.0f}s")
                self.assigned_since[job] = now  # said once per bound


async def unfinished(nc, accepted: set[str], timeout: float) -> list[str]:
    """Wait for every job the store holds to end; the violations left at `timeout`: accepted jobs that never
    ended, jobs stored but unknown to every scheduler (orphans), and accepted jobs missing from the store."""
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    deadline = time.monotonic() + timeout
    while True:
        stored = {k.removeprefix("request.") for k in await _keys(kv) if k.startswith("request.")}
        open_: list[str] = []
        for job in sorted(stored):
            entry = await _status_of(kv, job)
            if entry is None or entry.state not in TERMINAL_STATES:
                open_.append(f"job {job} is {entry.state if entry else 'queued'}")
        missing = [f"accepted job {j} is not in the store" for j in sorted(accepted - stored)]
        if (not open_ and not missing) or time.monotonic() > deadline:
            return open_ + missing
        await asyncio.sleep(0.5)


def trainer_overlaps(log: Path, bound_s: float) -> list[str]:
    """Jobs two of whose attempts computed steps at once for longer than `bound_s` (from the HOLD_LOG lines
    `job attempt step time pid`)."""
    spans: dict[str, dict[int, list[float]]] = defaultdict(dict)
    if log.exists():
        for line in log.read_text().splitlines():
            job, attempt, _step, at, _pid = line.split()
            span = spans[job].setdefault(int(attempt), [float(at), float(at)])
            span[0], span[1] = min(span[0], float(at)), max(span[1], float(at))
    out = []
    for job, attempts in spans.items():
        ordered = sorted(attempts.items())
        for (a, (start_a, end_a)), (b, (start_b, end_b)) in zip(ordered, ordered[1:]):
            overlap = min(end_a, end_b) - max(start_a, start_b)
            if overlap > bound_s:
                out.append(f"job {job}: attempts {a} and {b} computed at once for {overlap:.1f}s")
    return out


async def _keys(kv) -> list[str]:
    try:
        return await kv.keys()
    except Exception:  # nats-py's word for an empty bucket is an error
        return []


async def _status_of(kv, job: str) -> JobStatus | None:
    try:
        entry = await kv.get(f"{STATUS}.{job}")
    except Exception:
        return None
    return _status.decode(entry.value) if entry.value else None
