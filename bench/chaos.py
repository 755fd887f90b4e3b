"""Random faults against a real stack for minutes on end, the invariants checked throughout.

Two schedulers, three agents (4 simulated GPUs each, the stand-in trainer), the artifact service and nats-server
(a 3-server JetStream cluster with --cluster), every service behind its own proxy (tests/harness). Submissions
arrive steadily (some cancelled); faults come at random: a process frozen (SIGSTOP), cut off (blackholed), its
JetStream writes dropped or delayed, its connection reset, or the process killed and restarted; with --cluster, a
server killed and restarted. At the end every accepted and stored job must have ended once, and throughout: no
terminal state replaced, no device held by two jobs, no job assigned too long, no two trainers of a job at once,
no accepted job failed unless a fault of its own (its node, the artifact service, a server) came just before:
a leader stalled past its lease and let run again ("stall leader") must not end what its successor decided; and no
job placed a second time (attempt 2 and on) unless a fault hit the node of its previous attempt, or the scheduler
leading then, or a server, just before: bursts of groupable jobs (co-training on) come every --burst-every seconds.
It exits non-zero naming each violation.

Run by hand:  python bench/chaos.py --minutes 30 [--cluster] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from bench import chaos_shares  # noqa: E402
from schemas import names  # noqa: E402
from schemas.job_records import decode_status, status_key  # noqa: E402
from schemas.leadership import LEASE_KEY, decode_lease  # noqa: E402
from schemas.jobs import Accepted, Error  # noqa: E402
from schemas.job_status import JobQuery, JobReply  # noqa: E402
from services import bus  # noqa: E402
from tests.conftest import answering, submit  # noqa: E402
from tests.harness import Stack  # noqa: E402
from tests.harness.invariants import StatusWatch, trainer_overlaps, unfinished  # noqa: E402
from tests.qa import pairs  # noqa: E402

SCHEDULERS, AGENTS = ("sched-a", "sched-b"), ("n1", "n2", "n3")
WRITES = {  # what each kind of process writes into JetStream
    "sched": ("$KV.jetlora_jobs.", "$KV.jetlora_lease.", "jetlora.jobindex."),
    "n": ("jetlora.job.", "$O."),
    "artifacts": ("$O.",),
}


class Fault(NamedTuple):
    """One fault injected: when it began (wall time), its kind, the process it hit, the scheduler leading then."""

    at: float
    kind: str
    name: str
    leader: str | None


class Chaos:
    """Injects one random fault at a time into the stack's processes, counting each kind."""

    def __init__(self, stack: Stack, rng: random.Random, cluster: bool, nc) -> None:
        self.stack, self.rng, self.cluster, self.nc = stack, rng, cluster, nc
        self.injected: collections.Counter[str] = collections.Counter()
        self.log: list[Fault] = []

    async def leader(self) -> str | None:
        """Which of the stack's schedulers holds the lease now (None: none, or not known)."""
        try:
            value = (await (await self.nc.jetstream().key_value(names.LEASE_KV)).get(LEASE_KEY)).value
        except Exception:
            return None
        holder = decode_lease(value or b"").holder
        return next((n for n in SCHEDULERS if f"{holder} holds the scheduler lease" in self.stack.log(n)), None)

    async def one(self) -> None:
        rng, stack = self.rng, self.stack
        name = rng.choice([*SCHEDULERS, *AGENTS, "artifacts"])
        seconds = round(rng.uniform(1.0, 8.0), 1)
        kind = rng.choice(
            ["freeze", "blackhole", "drop writes", "delay writes", "reset", "kill", "stall leader"]
            + ["server"] * self.cluster
        )
        leader = await self.leader()
        if kind == "stall leader":  # past its lease: a standby takes over; then it runs again, with stale memory
            name = leader or SCHEDULERS[0]
            seconds = round(rng.uniform(3.5, 8.0), 1)
        elif kind == "server":  # named before it is logged: the invariants look for servers' faults by name
            server = rng.randrange(len(stack.servers))
            name = f"server s{server}"
        self.log.append(Fault(time.time(), kind, name, leader))
        if kind in ("freeze", "stall leader"):
            await stack.stall_for(name, seconds)
        elif kind == "blackhole":
            stack.blackhole(name, seconds)
            await asyncio.sleep(seconds)
        elif kind in ("drop writes", "delay writes"):
            mode = "drop" if kind == "drop writes" else "delay"
            prefixes = next(v for k, v in WRITES.items() if name.startswith(k))
            stack.hold_writes(name, prefixes, mode=mode, seconds=seconds, delay_s=min(seconds, 3.0))
            await asyncio.sleep(seconds)
        elif kind == "reset":
            stack.cut(name)
        elif kind == "kill":
            stack.kill(name)
            await asyncio.sleep(seconds / 4)
            stack.restart(name)
        else:
            stack.servers[server].kill()
            await asyncio.sleep(seconds / 2)
            stack.servers[server].start()
        self.injected[kind] += 1
        print(f"{time.strftime('%H:%M:%S')} {kind} {name} ({seconds}s)", flush=True)


async def submitting(nc, until: float, rate: float, rng: random.Random, accepted: set[str], counts) -> None:
    """Submit about `rate` jobs a second until `until`; cancel one in ten a moment later."""
    i = 0
    while time.monotonic() < until:
        i += 1
        body = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "retries": rng.choice([0, 1, 2, 3])}
        counts["submitted"] += 1
        try:
            reply = await asyncio.wait_for(submit(nc, {**body, "idempotency_key": f"chaos-{i}"}), 5.0)
            if isinstance(reply, Accepted):
                accepted.add(reply.job)
                if rng.random() < 0.1:
                    asyncio.get_running_loop().call_later(rng.uniform(0, 3), _cancel, nc, reply.job)
        except (bus.RequestError, TimeoutError):
            counts["unanswered"] += 1
        await asyncio.sleep(rng.expovariate(rate))


async def jobs_that_trained_in_a_group(nc, accepted: set[str]) -> set[str]:
    """Accepted jobs whose record shows a co-training group (that bursts did form groups under the faults)."""
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    out = set()
    for job in accepted:
        try:
            status = decode_status((await kv.get(status_key(job))).value or b"")
        except Exception:
            continue
        if status.group or any("co-training group" in m for m in [status.message]):
            out.add(job)
    return out


OWN_FAULT_S = 20.0  # a job may fail this long after a fault of its own node, the artifact service or a server


async def failures_without_a_fault_of_their_own(nc, accepted: set[str], faults: list) -> list[str]:
    """Accepted jobs that failed with no fault near them: their node, the artifact service and the servers ran
    undisturbed in the OWN_FAULT_S before (a job whose retries a node's faults used up may fail; one a scheduler's
    fault ended may not)."""
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    out = []
    for job in sorted(accepted):
        try:
            status = decode_status((await kv.get(status_key(job))).value or b"")
        except Exception:
            continue
        if status.state != "failed":
            continue
        near = [
            (f.kind, f.name)
            for f in faults
            if status.updated - OWN_FAULT_S <= f.at <= status.updated
            and (f.name in (status.node, "artifacts") or f.name.startswith("server"))
        ]
        if not near:
            out.append(f"job {job} failed on {status.node} with no fault of its own: {status.message}")
    return out


async def bursting(nc, until: float, every: float, rng: random.Random, accepted: set[str], counts) -> None:
    """Every `every` seconds or so, a burst of 12 jobs of one kind at once: what the scheduler groups (small jobs,
    several to a device)."""
    n = 0
    while time.monotonic() < until:
        await asyncio.sleep(rng.expovariate(1 / every))
        n += 1
        body = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": 1000, "retries": 3}
        replies = await asyncio.gather(
            *(asyncio.wait_for(submit(nc, {**body, "idempotency_key": f"burst-{n}-{i}"}), 5.0) for i in range(12)),
            return_exceptions=True,
        )
        counts["submitted"] += len(replies)
        counts["in bursts"] += len(replies)
        for reply in replies:
            if isinstance(reply, Accepted):
                accepted.add(reply.job)
            else:
                counts["unanswered"] += 1


def placed_again_without_a_fault(placements: dict[str, list[tuple[int, str, float]]], faults: list[Fault]) -> list[str]:
    """Jobs placed a second time (attempt 2 and on) with no fault that could have cost them their earlier attempt:
    none hit that attempt's node, the scheduler leading at the time, the artifact service (an upload refused ends
    the attempt) or a server, from OWN_FAULT_S before that attempt was placed until the next one was. One line a
    job: its placements with no fault, the first of them and the nodes."""
    out = []
    for job, placed in sorted(placements.items()):
        bare = [
            (attempt, node, again_on)
            for (_, node, since), (attempt, again_on, at) in zip(placed, placed[1:])
            if not any(
                since - OWN_FAULT_S <= f.at <= at
                and (f.name in (node, f.leader, "artifacts") or f.kind == "stall leader" or f.name.startswith("server"))
                for f in faults
            )
        ]
        if bare:
            attempt, node, again_on = bare[0]
            nodes = sorted({n for _, n, _ in bare} | {n for _, _, n in bare})
            out.append(
                f"job {job} was placed again {len(bare)} times with no fault of its node, its leader, the artifact "
                f"service or a server (the first: attempt {attempt} on {again_on}, after {node}; nodes {nodes})"
            )
    return out


def _cancel(nc, job: str) -> None:
    async def cancel() -> None:
        try:
            await bus.request(nc, names.CANCEL, JobQuery(job), JobReply | Error, timeout=5)
        except bus.RequestError:
            pass

    asyncio.ensure_future(cancel())


async def main(args) -> int:
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="jetlora-chaos-"))
    log = tmp / "steps"
    async with Stack(tmp, cluster=args.cluster) as stack:
        shares = args.mix == "fair-share"  # bench/chaos_shares.py's tenants, shapes and invariant
        for name in SCHEDULERS:  # co-training on (the product's default): bursts form groups on the stand-in
            stack.start_scheduler(
                name, "--co-train", "same-tenant", *(chaos_shares.scheduler_flags() if shares else ())
            )
        stack.start_artifacts("artifacts")
        for i, name in enumerate(AGENTS):
            hold_s = chaos_shares.HOLD_S if shares else 1.0 + i
            stack.start_agent(name, gpus="4096,4096,4096,4096", hold_s=hold_s, env={"HOLD_LOG": str(log)})
        nc = await nats.connect(servers=stack.client_url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        await answering(nc, names.LIST_JOBS)
        watch = await StatusWatch(nc.jetstream(), assigned_bound_s=30.0).start()
        chaos, accepted, counts = Chaos(stack, rng, args.cluster, nc), set(), collections.Counter()
        until = time.monotonic() + args.minutes * 60
        load = asyncio.create_task(
            chaos_shares.submitting(nc, until, args.rate, rng, AGENTS, accepted, counts)
            if shares
            else submitting(nc, until, args.rate, rng, accepted, counts)
        )
        bursts = asyncio.create_task(bursting(nc, until, args.burst_every, rng, accepted, counts))
        while time.monotonic() < until:
            await asyncio.sleep(rng.expovariate(1 / args.fault_every))
            if time.monotonic() < until:
                await chaos.one()
            watch.check_assigned()
        await asyncio.gather(load, bursts)
        left = await unfinished(nc, accepted, timeout=300)
        await watch.stop()
        overlaps = trainer_overlaps(log, bound_s=2.0)
        failed = await failures_without_a_fault_of_their_own(nc, accepted, chaos.log)
        placements = await chaos_shares.not_preempted(nc, watch.placements) if shares else watch.placements
        again = placed_again_without_a_fault(placements, chaos.log)
        again += chaos_shares.share_violations(stack, SCHEDULERS, chaos.log) if shares else []
        grouped = await jobs_that_trained_in_a_group(nc, accepted)
        await nc.close()
    violations = left + watch.violations + overlaps + failed + again
    print(f"\n{args.minutes:g} minutes, {'3-server cluster' if args.cluster else 'one server'}, seed {args.seed}")
    print(
        f"faults injected: {sum(chaos.injected.values())} ({', '.join(f'{k} {v}' for k, v in chaos.injected.items())})"
    )
    print(
        f"jobs submitted: {counts['submitted']} ({counts['in bursts']} in bursts of groupable jobs), accepted: "
        f"{len(accepted)}, unanswered: {counts['unanswered']}, grouped: {len(grouped)}"
    )
    print(f"status writes seen: {watch.writes}")
    print(
        f"jobs placed more than once: {sum(len(p) > 1 for p in watch.placements.values())} ({len(again)} with no fault)"
    )
    print(f"violations: {len(violations)}")
    for v in violations[:50]:
        print(f"  {v}")
    print(f"logs: {tmp}")
    return 1 if violations else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--fault-every", type=float, default=15.0, help="mean seconds between faults")
    p.add_argument("--rate", type=float, default=2.0, help="submissions a second")
    p.add_argument("--burst-every", type=float, default=60.0, help="mean seconds between bursts of groupable jobs")
    p.add_argument("--cluster", action="store_true", help="a 3-server JetStream cluster, servers killed too")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mix", choices=("plain", "fair-share"), default="plain", help="fair-share: bench/chaos_shares.py")
    sys.exit(asyncio.run(main(p.parse_args())))
