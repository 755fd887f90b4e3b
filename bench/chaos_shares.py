"""bench/chaos.py's fair-share fault mix (`--mix fair-share`, a hook there): tenants of several weights submit jobs of
every shape (on one device, on two, pinned to a node, co-training in a group of their own, priorities -1 to 2), the
schedulers share the fleet fairly (preemption by checkpoint, a short --min-run-s), and the faults go on as in every
mix (a leader stalled past its lease among them). Beside chaos.py's invariants (a preempted job's placing again is
preemption's, not a fault's), the fair share's: the leader's share watch (services/scheduler/share_watch.py) logs
each wait of a tenant below its share, with a job it is owed, for a device while another tenant held more than its
share, that went past --min-run-s and a heartbeat window; one past --min-run-s and a preemption's settle time
(SETTLE_S, as bench/fair_share.py's --settle-s) is a violation unless a fault began near it (REACH_S before it, or
during it): a stalled leader preempts nobody, a frozen node frees nothing."""

from __future__ import annotations

import asyncio
import random
import re
import time
from datetime import datetime

from schemas import names
from schemas.job_records import decode_status, status_key
from schemas.jobs import Accepted, SubmitReply
from services import bus
from tests.qa import pairs

TENANTS = {"acme": 1, "globex": 2, "initech": 1}  # weights
MIN_RUN_S, BACKOFF_S = 2.0, 10.0
SETTLE_S = 3.0  # a preemption's settle time: the pause sent, the checkpoint stored, the device seen free and placed
# (bench/fair_share.py's --settle-s); the invariant's bound is MIN_RUN_S + SETTLE_S
HOLD_S = 8.0  # each job's hold on the stand-in trainer: long enough that tenants contend for the devices
REACH_S = 10.0  # a wait that began up to this long after a fault (or during one) may be the fault's doing
WAITED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*fair share: tenant (\S+) waited ([\d.]+)s below its share without a "
    r"device gained .*allowed: ([\d.]+)s",
    re.MULTILINE,
)


def scheduler_flags() -> list[str]:
    """Fair sharing among the mix's tenants, preemption quick enough to see in minutes."""
    flags = ["--sharing", "fair", "--min-run-s", str(MIN_RUN_S), "--preempt-backoff-s", str(BACKOFF_S)]
    for tenant, weight in TENANTS.items():
        flags += ["--quota", f"{tenant}=weight:{weight},priority:2"]
    return flags


def shaped(rng: random.Random, nodes: tuple[str, ...]) -> dict:
    """One job of the mix: on one device (most), on two, pinned to a node, or co-training; priorities -1 to 2."""
    kind = rng.choices(["one", "two", "pinned", "group"], [0.5, 0.15, 0.15, 0.2])[0]
    job = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": 1000, "retries": 3}
    job |= {"priority": rng.choice([-1, 0, 0, 1, 2]), "co_train": kind == "group"}
    if kind == "two":
        job["devices"] = 2
    elif kind == "pinned":
        job["node"] = rng.choice(nodes)
    return job


async def submitting(nc, until: float, rate: float, rng: random.Random, nodes, accepted: set[str], counts) -> None:
    """About `rate` jobs a second of the mix's tenants, in small bursts of one tenant (so that one goes below its
    share while another holds more), until `until`."""
    i = 0
    while time.monotonic() < until:
        tenant = rng.choice(list(TENANTS))
        burst = rng.randint(1, 6)
        for _ in range(burst):
            i += 1
            body = {**shaped(rng, nodes), "idempotency_key": f"shares-{i}"}
            counts["submitted"] += 1
            counts[f"by {tenant}"] += 1
            try:
                reply = await bus.request(nc, names.jobs_api(tenant).submit, body, SubmitReply, timeout=5.0)
                if isinstance(reply, Accepted):
                    accepted.add(reply.job)
            except bus.RequestError:
                counts["unanswered"] += 1
        await asyncio.sleep(rng.expovariate(rate / burst))


def waits_past_bound(logs: dict[str, str], faults) -> tuple[list[str], int]:
    """(each wait past the bound with no fault near it, the waits past the bound seen), from the schedulers' logs
    (which log each past their own allowance, --min-run-s and a heartbeat window); faults: chaos.py's, each (wall
    time it began, kind, process, ...)."""
    out, seen = [], 0
    for scheduler, text in logs.items():
        for m in WAITED.finditer(text):
            ended = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            began, waited, bound = ended - float(m[3]), float(m[3]), MIN_RUN_S + SETTLE_S
            if waited <= bound:
                continue  # past the scheduler's own allowance (a heartbeat window for the settling), not the bound
            seen += 1
            near = [f"{f[1]} {f[2]}" for f in faults if began - REACH_S <= f[0] <= ended]
            if not near:
                out.append(
                    f"{scheduler}: tenant {m[2]} waited {waited:.1f}s below its fair share (bound {bound:.1f}s) with "
                    f"no fault near it, ending {m[1]}"
                )
    return out, seen


def share_violations(stack, schedulers, faults) -> list[str]:
    """The fair share's invariant over the run, printed: each wait past its bound with no fault near it."""
    out, seen = waits_past_bound({s: stack.log(s) for s in schedulers}, faults)
    print(
        f"fair share: {seen} waits of a tenant below its share for a device past {MIN_RUN_S + SETTLE_S:g} s "
        f"(--min-run-s {MIN_RUN_S:g} + settling {SETTLE_S:g} s) while another held more; {len(out)} with no fault near"
    )
    return out


async def not_preempted(nc, placements: dict[str, list]) -> dict[str, list]:
    """The placements of jobs never preempted: a preempted job is placed again by design, not by a fault."""
    again = {job for job, placed in placements.items() if len(placed) > 1}
    left_out = await preempted(nc, again)
    print(f"jobs preempted and placed again: {len(left_out)} (not counted as placed again by a fault)")
    return {job: placed for job, placed in placements.items() if job not in left_out}


async def preempted(nc, jobs: set[str]) -> set[str]:
    """Of `jobs`, those preempted at least once (their records say when)."""
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    out = set()
    for job in jobs:
        try:
            status = decode_status((await kv.get(status_key(job))).value or b"")
        except Exception:
            continue
        if status.preempted_at:
            out.add(job)
    return out
