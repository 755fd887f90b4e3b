"""The job mix bench/fair_share.py submits: bursts of a recorded shape (a tenant's burst of long jobs larger than the
fleet, then a second; another's bursts of medium jobs; a third's small burst of short jobs every few seconds), each
burst's jobs drawn from the shapes a shared GPU fleet sees (most jobs on one device, some on two, a few on a whole
node of eight, some pinned to one node, some co-training in a group of their tenant's on one device) at a few
priorities. Seeded: the same trace for every side and round."""

from __future__ import annotations

import random
from dataclasses import dataclass

GPU_MIB = 8000  # each job's memory per device (a co-training group holds up to 8 on an 81,920 MiB device)
SHAPES = (("one", 0.55), ("two", 0.12), ("eight", 0.05), ("pinned", 0.13), ("group", 0.15))  # share of a burst's jobs
PRIORITIES = (-1, 0, 0, 0, 1, 2)  # a tenant's jobs (each tenant's ceiling is 2)
TENANTS = {"acme": 1, "globex": 1, "initech": 2}  # weights


@dataclass(frozen=True)
class Shape:
    """One job of the trace: its work in seconds, its devices, the node it is pinned to, whether it co-trains."""

    work: float
    devices: int = 1
    node: str | None = None
    group: bool = False
    priority: int = 0

    def request(self) -> dict:
        """The submission (the simulated fleet runs `work` seconds of it, in steps of 0.5 s)."""
        job: dict = {
            "model": "bench",
            "base_dir": "/models/bench-co" if self.group else "/models/bench",
            "data": [{"q": "q?", "a": "a."}],
            "gpu_mib": GPU_MIB,
            "devices": self.devices,
            "priority": self.priority,
            "co_train": self.group,
            "label": f"sim:work={self.work},step=0.5",
        }
        if self.node is not None:
            job["node"] = self.node
        return job


def trace(nodes: int, gpus: int, seed: int) -> list[tuple[float, str, list[Shape]]]:
    """(when, tenant, its jobs) of every burst; a burst asks for about `share` of the fleet's devices."""
    rng = random.Random(seed)
    devices = nodes * gpus

    def job(low: float, high: float) -> Shape:
        kind = rng.choices([k for k, _ in SHAPES], [w for _, w in SHAPES])[0]
        work = round(rng.uniform(low, high), 2)
        priority = rng.choice(PRIORITIES)
        if kind in ("two", "eight"):
            return Shape(work, devices=min(gpus, 2 if kind == "two" else 8), priority=priority)
        if kind == "pinned":
            return Shape(work, node=f"node{rng.randrange(nodes):04d}", priority=priority)
        return Shape(work, group=kind == "group", priority=priority)

    def burst(t: float, tenant: str, share: float, low: float, high: float) -> tuple[float, str, list[Shape]]:
        jobs: list[Shape] = []
        while sum(j.devices for j in jobs) < devices * share:
            jobs.append(job(low, high))
        return (t, tenant, jobs)

    bursts = [burst(0.0, "acme", 1.1, 15, 30), burst(20.0, "acme", 0.2, 15, 30)]
    bursts += [burst(8.0, "globex", 0.3, 6, 14), burst(24.0, "globex", 0.2, 6, 14)]
    bursts += [burst(4.0 + 5 * i, "initech", 0.02, 1, 4) for i in range(6)]
    return sorted(bursts, key=lambda b: b[0])


def mix(bursts) -> str:
    """What the trace holds, in one line."""
    jobs = [j for _, _, js in bursts for j in js]
    kinds = {
        "on one device": sum(j.devices == 1 and not j.node and not j.group for j in jobs),
        "on 2": sum(j.devices == 2 for j in jobs),
        "on 8": sum(j.devices == 8 for j in jobs),
        "pinned": sum(j.node is not None for j in jobs),
        "co-training": sum(j.group for j in jobs),
    }
    return f"{len(jobs)} jobs (" + ", ".join(f"{n} {k}" for k, n in kinds.items()) + f"; priorities {PRIORITIES})"
