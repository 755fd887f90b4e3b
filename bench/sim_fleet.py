"""A simulated fleet for the control-plane benches: agents that heartbeat on the real subjects, take assignments
(one job per device, or several of one co-training group), run each job and report its states as a real agent does,
and obey the scheduler's controls: a pause stops the job at the end of its current step, stores a checkpoint there
(reported as the real agent reports one) and reports it `paused`; an assignment that resumes from a checkpoint goes
on from its step. Used by bench/control_plane.py and bench/fair_share.py.

A job's label `sim:work=S` says how many seconds of work it is (steps of `step=S` each, 0.5 s by default); without
one it runs a random 0.5-3 s. A pause costs `save` seconds of the device (writing the checkpoint) and a resume `load`
seconds (reading it back, loading the base): device-time lost to preemption, which the fleet counts."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import msgspec

from schemas import names, subject_parts
from schemas.events import StateChange
from schemas.job_status import CheckpointInfo
from schemas.nodes import (
    AssignAccepted,
    AssignRefused,
    Assignment,
    Control,
    ControlReply,
    Device,
    Heartbeat,
    RunningAttempt,
)

GPU_MIB = 81920
FINISHED_KEPT_S = 60.0  # how long a node lists a job that ended (services/agent/heartbeats.py's)
SAVE_S, LOAD_S = 0.2, 0.5  # what a pause and a resume cost a job's device (a checkpoint written, then read back)
enc = msgspec.json.Encoder()
dec_assign = msgspec.json.Decoder(Assignment)
dec_control = msgspec.json.Decoder(Control)


@dataclass
class SimJob:
    """One attempt running on a simulated device."""

    a: Assignment
    node: str
    work_s: float  # the whole job's work
    step_s: float
    step: int = 0  # steps done (including those before the checkpoint it resumed from)
    paused_by: str = ""  # a pause was asked, by this
    task: asyncio.Task | None = None

    @property
    def devices(self) -> int:
        """The devices it holds (device-time counts each)."""
        return len(self.a.devices) or 1


def job_shape(label: str) -> tuple[float, float]:
    """(work seconds, step seconds) from a `sim:work=S,step=S` label; else a random short job."""
    if label.startswith("sim:"):
        fields = dict(part.split("=", 1) for part in label[4:].split(",") if "=" in part)
        return float(fields.get("work", 1.0)), float(fields.get("step", 0.5))
    work = random.uniform(0.5, 3.0)
    return work, work


class Fleet:
    """Simulated agents: real heartbeats and replies; each job 'runs' its work, then succeeds."""

    def __init__(self, nc, nodes: int, gpus: int, doomed: int, interval: float):
        self.nc, self.js = nc, nc.jetstream()
        self.interval = interval
        self.nodes: dict[str, list[list[tuple[str, int, str | None]]]] = {
            f"node{i:04d}": [[] for _ in range(gpus)] for i in range(nodes)
        }  # node -> device -> (job, MiB, group) it runs
        self.assigns: dict[str, int] = {}  # job -> assignments it got (a second one: it was placed again)
        self.refused = 0
        self.doomed = set(list(self.nodes)[:doomed])
        self.silenced: set[str] = set()
        self.last_beat: dict[str, float] = {}
        self.assigned_at: dict[str, float] = {}
        self.held: dict[str, str] = {}  # job -> doomed node holding it
        self.attempts: dict[str, int] = {}  # job -> the attempt it runs as
        self.finished: dict[str, dict[str, float]] = {n: {} for n in self.nodes}  # job -> when it ended, a minute
        self.tasks: set[asyncio.Task] = set()
        self.running: dict[str, SimJob] = {}  # job -> its attempt running now
        self.done_at: dict[str, float] = {}  # job -> when it succeeded (monotonic)
        self.paused: dict[str, int] = {}  # job -> times it was paused
        self.lost_s = 0.0  # device-seconds spent saving and loading checkpoints for pauses, and redoing steps
        self.work_s = 0.0  # device-seconds of useful work done

    def _recently_finished(self, node: str) -> list[str]:
        """The node's jobs that ended in the last FINISHED_KEPT_S, as a real agent lists them (services/agent/
        heartbeats.py), however many: a device of a co-training group ends dozens within seconds, and a list cut
        to the last few had the scheduler take a job whose end it had not read yet for one its node lost."""
        kept, horizon = self.finished[node], time.monotonic() - FINISHED_KEPT_S
        while kept and next(iter(kept.values())) < horizon:  # in the order they ended: the oldest first
            del kept[next(iter(kept))]
        return list(kept)

    def heartbeat(self, node: str) -> bytes:
        devices = [
            Device(
                index=i,
                name="simulated H100",
                total_mib=GPU_MIB,
                free_mib=GPU_MIB - sum(need for _, need, _ in held),
                jobs=[job for job, _, _ in held],
            )
            for i, held in enumerate(self.nodes[node])
        ]
        on: dict[str, tuple[list[int], str | None]] = {}  # job -> its devices (several: a multi-device job), group
        for i, held in enumerate(self.nodes[node]):
            for job, _, group in held:
                on.setdefault(job, ([], group))[0].append(i)
        attempts = [
            RunningAttempt(job=job, attempt=self.attempts.get(job, 1), devices=devices, state="running", group=group)
            for job, (devices, group) in on.items()
        ]
        return enc.encode(
            Heartbeat(
                node=node,
                agent_version="sim",
                devices=devices,
                running=[a.job for a in attempts],
                attempts=attempts,
                finished=self._recently_finished(node),
                interval_s=self.interval,
                sent_at=time.time(),
            )
        )

    async def beat_forever(self):
        order = list(self.nodes)
        while True:
            start = time.monotonic()
            for i, node in enumerate(order):
                if node not in self.silenced:
                    await self.nc.publish(names.node(node).heartbeat, self.heartbeat(node))
                    self.last_beat[node] = time.monotonic()
                if i % 50 == 49:  # spread the fleet's beats over the interval
                    await asyncio.sleep(max(0.0, start + self.interval * (i + 1) / len(order) - time.monotonic()))
            await asyncio.sleep(max(0.0, start + self.interval - time.monotonic()))

    async def subscribe(self) -> None:
        """Take assignments and controls for every simulated node."""
        await self.nc.subscribe(names.node("*").assign, cb=self.on_assign)
        await self.nc.subscribe(names.node("*").control, cb=self.on_control)

    async def on_assign(self, msg):
        """A device takes one job, or several of one co-training group (as a real agent's group process does)."""
        now = time.monotonic()
        a = dec_assign.decode(msg.data)
        node = subject_parts.node_of_subject(msg.subject)
        self.assigned_at.setdefault(a.job, now)
        self.assigns[a.job] = self.assigns.get(a.job, 0) + 1
        devices = [self.nodes[node][d] for d in (a.devices or [a.device])]  # all of a multi-device job's
        if any(group != a.group or group is None for held in devices for _, _, group in held):
            self.refused += 1
            await msg.respond(enc.encode(AssignRefused(a.job, "the device runs another job")))
            return
        for held in devices:
            held.append((a.job, a.need_mib if a.need_mib is not None else a.request.gpu_mib, a.group))
        self.attempts[a.job] = a.attempt
        await msg.respond(enc.encode(AssignAccepted(a.job)))
        work, step = job_shape(a.request.label)
        job = SimJob(a, node, work, step, step=_step_of(a.resume_from))
        self.running[a.job] = job
        job.task = asyncio.create_task(self.run_job(job))
        self.tasks.add(job.task)
        job.task.add_done_callback(self.tasks.discard)

    async def on_control(self, msg):
        """Pause: stop at the end of the step under way and checkpoint there; cancel, stop, end: gone at once."""
        c = dec_control.decode(msg.data)
        job = self.running.get(c.job)
        if job is None or job.node != subject_parts.node_of_subject(msg.subject) or c.attempt not in (0, job.a.attempt):
            await msg.respond(enc.encode(ControlReply(c.job, False, "no such attempt runs here")))
            return
        if c.action == "pause":
            job.paused_by = c.by or "user"
        elif job.task is not None:
            job.task.cancel()
            self._free(job)
        await msg.respond(enc.encode(ControlReply(c.job, True, f"{c.action} sent")))

    async def report(self, a: Assignment, node: str, state: str, **extra):
        ev = StateChange(
            job=a.job, state=state, node=node, attempt=a.attempt, message=extra.pop("message", state), ts=time.time()
        )
        ev = msgspec.structs.replace(ev, **extra)
        await self.js.publish(names.job(a.job, node, names.tenant_token(a.tenant)).state, enc.encode(ev))

    async def run_job(self, job: SimJob):
        a, node = job.a, job.node
        await self.report(a, node, "running")
        if node in self.doomed:
            self.held[a.job] = node
            return  # held until the node is killed
        if a.resume_from:
            await asyncio.sleep(LOAD_S)
            self.lost_s += LOAD_S * job.devices
        steps = max(1, round(job.work_s / job.step_s))
        while job.step < steps:  # a pause takes effect at the end of the step under way, as the real trainer's
            started = time.monotonic()
            await asyncio.sleep(job.work_s / steps)
            job.step += 1
            self.work_s += (time.monotonic() - started) * job.devices
            if job.paused_by and job.step < steps:
                await self._pause(job)
                return
        await self.report(a, node, "succeeded")
        self.done_at[a.job] = time.monotonic()
        self._free(job)

    async def _pause(self, job: SimJob) -> None:
        """Stop-and-save: a checkpoint at the step reached, reported as a real agent reports it, then `paused`."""
        a, node = job.a, job.node
        await asyncio.sleep(SAVE_S)
        self.lost_s += SAVE_S * job.devices
        info = CheckpointInfo(step=job.step, name=f"sim-{a.job}-{job.step}", created=time.time())
        await self.report(a, node, "running", message=f"checkpoint at step {job.step} stored", checkpoint=info)
        self.paused[a.job] = self.paused.get(a.job, 0) + 1
        await self.report(a, node, "paused", message=f"paused at step {job.step}", paused_by=job.paused_by)
        self._free(job)

    def _free(self, job: SimJob) -> None:
        """The job's device is free; heartbeats list it among the node's finished, as a real agent's do (so the
        scheduler does not take a job whose last state is on its way for one its node lost)."""
        a, node = job.a, job.node
        for d in a.devices or [a.device]:
            self.nodes[node][d] = [h for h in self.nodes[node][d] if h[0] != a.job]
        self.finished[node].pop(a.job, None)  # a job paused here and ended later: listed from its end
        self.finished[node][a.job] = time.monotonic()
        if self.running.get(a.job) is job:
            del self.running[a.job]


def _step_of(checkpoint: str | None) -> int:
    """The step a `sim-<job>-<step>` checkpoint was taken at (0: none)."""
    return int(checkpoint.rsplit("-", 1)[1]) if checkpoint else 0
