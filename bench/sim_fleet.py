"""A simulated fleet for the control-plane benches: agents that heartbeat on the real subjects, take assignments
(one job per device, or several of one co-training group), run each job a short random time and report its states
as a real agent does. Used by bench/control_plane.py."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec

from schemas import names
from schemas.events import StateChange
from schemas.nodes import AssignAccepted, AssignRefused, Assignment, Device, Heartbeat, RunningAttempt

GPU_MIB = 81920
enc = msgspec.json.Encoder()
dec_assign = msgspec.json.Decoder(Assignment)


class Fleet:
    """Simulated agents: real heartbeats and replies; each job 'runs' a random short time, then succeeds."""

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
        self.finished: dict[str, list[str]] = {n: [] for n in self.nodes}  # recent, as real agents report them
        self.tasks: set[asyncio.Task] = set()

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
        attempts = [
            RunningAttempt(job=job, attempt=self.attempts.get(job, 1), devices=[i], state="running", group=group)
            for i, held in enumerate(self.nodes[node])
            for job, _, group in held
        ]
        return enc.encode(
            Heartbeat(
                node=node,
                agent_version="sim",
                devices=devices,
                running=[a.job for a in attempts],
                attempts=attempts,
                finished=self.finished[node][-16:],
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

    async def on_assign(self, msg):
        """A device takes one job, or several of one co-training group (as a real agent's group process does)."""
        now = time.monotonic()
        a = dec_assign.decode(msg.data)
        node = names.node_of_subject(msg.subject)
        self.assigned_at.setdefault(a.job, now)
        self.assigns[a.job] = self.assigns.get(a.job, 0) + 1
        held = self.nodes[node][a.device]
        if any(group != a.group or group is None for _, _, group in held):
            self.refused += 1
            await msg.respond(enc.encode(AssignRefused(a.job, "the device runs another job")))
            return
        held.append((a.job, a.need_mib if a.need_mib is not None else a.request.gpu_mib, a.group))
        self.attempts[a.job] = a.attempt
        await msg.respond(enc.encode(AssignAccepted(a.job)))
        t = asyncio.create_task(self.run_job(node, a))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def report(self, a: Assignment, node: str, state: str):
        ev = StateChange(job=a.job, state=state, node=node, attempt=a.attempt, message=state, ts=time.time())
        await self.js.publish(names.job(a.job, node, names.tenant_token(a.tenant)).state, enc.encode(ev))

    async def run_job(self, node: str, a: Assignment):
        await self.report(a, node, "running")
        if node in self.doomed:
            self.held[a.job] = node
            return  # held until the node is killed
        await asyncio.sleep(random.uniform(0.5, 3.0))
        await self.report(a, node, "succeeded")
        self.nodes[node][a.device] = [h for h in self.nodes[node][a.device] if h[0] != a.job]
        self.finished[node].append(a.job)
