"""A node that speaks the agent's side of the protocol from the test's own connection, with no trainer: for tests
of the scheduler alone that need a node to answer late, never, or to report what the test says when it says.

It heartbeats its devices (free memory as the test sets it), takes assignments, lists what it runs with their
attempts, reports states into the JOBS stream as an agent does, and answers controls only if told to."""

from __future__ import annotations

import asyncio
import time

import msgspec

from schemas import names
from schemas.events import StateChange
from schemas.job_status import JobState
from schemas.nodes import AssignAccepted, Assignment, Control, ControlReply, Device, Heartbeat, RunningAttempt
from services import bus

_enc = msgspec.json.Encoder()
_assignment = msgspec.json.Decoder(Assignment)
_control = msgspec.json.Decoder(Control)


class ScriptedNode:
    """One node named `node` with `gpus` devices of `mib` MiB each."""

    def __init__(self, nc, node: str, gpus: int = 1, mib: int = 24576, interval: float = 0.25) -> None:
        self.nc, self.js, self.node, self.interval = nc, nc.jetstream(), node, interval
        self.free = {i: mib for i in range(gpus)}
        self.total = mib
        self.running: dict[str, Assignment] = {}  # job -> its attempt here
        self.states: dict[str, JobState] = {}
        self.finished: list[str] = []  # jobs that ended here, listed in heartbeats as agents list them
        self.answer_controls = True
        self.answer_assignments = True  # False: an assignment is kept (assignments) but never answered nor run
        self.assigned_at: list[float] = []  # when each assignment came (monotonic)
        self.controls: list[Control] = []
        self.assignments: list[Assignment] = []
        self._tasks: list[asyncio.Task] = []
        self._subs: list = []
        self._reports = 0

    async def start(self) -> "ScriptedNode":
        subjects = names.node(self.node)
        self._subs = [
            await self.nc.subscribe(subjects.assign, cb=self._on_assign),
            await self.nc.subscribe(subjects.control, cb=self._on_control),
        ]
        self._tasks.append(asyncio.create_task(self._beat()))
        return self

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sub in self._subs:
            await sub.unsubscribe()

    def heartbeat(self) -> Heartbeat:
        on: dict[int, list[str]] = {}
        for job, a in self.running.items():
            for d in a.ranks:
                on.setdefault(d, []).append(job)
        devices = [
            Device(index=i, total_mib=self.total, free_mib=free, jobs=on.get(i, [])) for i, free in self.free.items()
        ]
        attempts = [
            RunningAttempt(job=j, attempt=a.attempt, devices=a.ranks, state=self.states.get(j, "preparing"))
            for j, a in self.running.items()
        ]
        return Heartbeat(
            node=self.node,
            agent_version="scripted",
            devices=devices,
            running=list(self.running),
            attempts=attempts,
            finished=self.finished[-100:],
            interval_s=self.interval,
            sent_at=time.time(),
        )

    async def _beat(self) -> None:
        while True:
            await self.nc.publish(names.node(self.node).heartbeat, _enc.encode(self.heartbeat()))
            await asyncio.sleep(self.interval)

    async def _on_assign(self, msg) -> None:
        a = _assignment.decode(msg.data)
        self.assignments.append(a)
        self.assigned_at.append(time.monotonic())
        if not self.answer_assignments:
            return
        self.running[a.job] = a
        await msg.respond(_enc.encode(AssignAccepted(a.job)))

    async def _on_control(self, msg) -> None:
        c = _control.decode(msg.data)
        self.controls.append(c)
        if c.action == "end" and c.job in self.running and c.attempt in (0, self.running[c.job].attempt):
            del self.running[c.job]
        if self.answer_controls:
            await msg.respond(_enc.encode(ControlReply(c.job, True, f"{c.action} noted")))

    async def report(self, job: str, state: JobState, message: str = "") -> None:
        """Publish the job's state as its agent would (it must run here); a final state ends it here."""
        a = self.running[job]
        self._reports += 1
        ev = StateChange(
            job=job, state=state, node=self.node, attempt=a.attempt, message=message or state, ts=time.time()
        )
        subject = names.job(job, self.node, names.tenant_token(a.tenant)).state
        await bus.publish_durably(self.js, subject, _enc.encode(ev), f"{job}.{a.attempt}.s{self._reports}")
        if state in ("preparing", "running", "uploading"):
            self.states[job] = state
        else:
            self.running.pop(job, None)
            self.states.pop(job, None)
            self.finished.append(job)
