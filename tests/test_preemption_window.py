"""A tenant below its share is not kept from preemption by the multi-device jobs at its queue's head (#62, review):
the check passes over a tenant's waiting job it could not be given, up to MISSES (32) in a row, then leaves that
tenant. A job that asks for more devices than its tenant is owed is not searched at all (no victim could be taken
for it without taking the tenant past its share), yet it counted as one of those misses: 32 such jobs at the head
of a queue hid the 1-device jobs behind them from preemption for good, the tenant below its share, another over it.
On a scheduler's memory projected from statuses and heartbeats (nothing is sent: the check's choices are looked
at), as tests/test_preemption_once.py does."""

from __future__ import annotations

import asyncio
import time

from schemas.job_status import JobStatus, StoredRequest
from schemas.jobs import JobRequest
from schemas.nodes import Device, Heartbeat, RunningAttempt
from services.scheduler.config import TenantQuota
from services.scheduler.core import SchedulerConfig, SchedulerCore
from services.scheduler.pausing import Pausing
from services.scheduler.preemption import MISSES, Preemption
from services.scheduler import sharing
from tests.test_fair_share import NoBus

MIB = 16384


def fleet_with_big_jobs_first(big: int) -> SchedulerCore:
    """n1 and n2 (4 devices each) run eight of acme's jobs; globex (same weight) waits with `big` 6-device jobs
    (each more than its share of 4), then two 1-device jobs."""
    core = SchedulerCore(NoBus(), SchedulerConfig(min_run_s=0.0))  # type: ignore[arg-type]

    def adopt(job: str, tenant: str, status: JobStatus, devices: int = 1) -> None:
        request = JobRequest(model="m", base_dir="/models/m", gpu_mib=8000, devices=devices)
        core.adopt(StoredRequest(id=job, request=request, created=time.time(), tenant=tenant), status, 1)

    for node in ("n1", "n2"):
        jobs = [f"a-{node}-{i}" for i in range(4)]
        devices = [Device(index=i, total_mib=MIB, free_mib=0, jobs=[j]) for i, j in enumerate(jobs)]
        attempts = [RunningAttempt(job=j, attempt=1, devices=[i], state="running") for i, j in enumerate(jobs)]
        core.fleet.heard(Heartbeat(node=node, agent_version="t", devices=devices, attempts=attempts))
        for i, job in enumerate(jobs):
            adopt(job, "acme", JobStatus(state="running", node=node, device=i, attempt=1))
    for i in range(big):
        adopt(f"big{i}", "globex", JobStatus(), devices=6)
    adopt("small0", "globex", JobStatus())
    adopt("small1", "globex", JobStatus())
    return core


async def check_small_jobs_get_victims(big: int) -> None:
    core = fleet_with_big_jobs_first(big)
    table = sharing.shares(core)
    assert (table.share, table.held) == ({"acme": 4, "globex": 4}, {"acme": 8, "globex": 0}), table
    preemption = Preemption(core, Pausing(core))
    try:
        preemption.check()
        chosen = sorted((f.waiting, f.frm) for f in preemption.in_flight.values())
        assert chosen == [("small0", "acme"), ("small1", "acme")], (big, preemption.in_flight, preemption.stats)
    finally:  # the pauses it sent have no node to go to here
        for task in list(core.tasks):
            task.cancel()
        await asyncio.gather(*core.tasks, return_exceptions=True)


async def test_a_few_big_jobs_at_the_head_hide_nothing():
    """Below MISSES of them: the 1-device jobs behind are given one of acme's jobs each at the first check."""
    await check_small_jobs_get_victims(MISSES - 1)


async def test_many_big_jobs_at_the_head_do_not_hide_the_small_ones_from_preemption():
    """MISSES and more of them (a tenant's queue of 8-device jobs in bench/fair_share.py's mix): the 1-device jobs
    behind still get their victims (before: none, at any check, while acme held 8 of its 4)."""
    await check_small_jobs_get_victims(MISSES + 8)


def node_half_free_beside_a_young_one() -> SchedulerCore:
    """n1 (4 devices) has two free and runs acme's a1 and a2; n2's four devices run acme's b0-b3, preempted lately
    (not to be taken again). globex (weight 3) waits with two 3-device jobs: shares globex 6, acme 2 (it holds 6).
    a1 or a2, stopped, makes room on n1 for one 3-device job; n1 never holds two."""
    core = SchedulerCore(
        NoBus(),  # type: ignore[arg-type]
        SchedulerConfig(min_run_s=0.0, quotas={"globex": TenantQuota(weight=3)}),
    )
    layout = {"n1": ["a1", "a2"], "n2": ["b0", "b1", "b2", "b3"]}
    for node, jobs in layout.items():
        devices = [Device(index=i, total_mib=MIB, free_mib=0 if i < len(jobs) else MIB) for i in range(4)]
        for i, job in enumerate(jobs):
            devices[i].jobs = [job]
        attempts = [RunningAttempt(job=j, attempt=1, devices=[i], state="running") for i, j in enumerate(jobs)]
        core.fleet.heard(Heartbeat(node=node, agent_version="t", devices=devices, attempts=attempts))

    def adopt(job: str, tenant: str, status: JobStatus, devices: int = 1) -> None:
        request = JobRequest(model="m", base_dir="/models/m", gpu_mib=8000, devices=devices)
        core.adopt(StoredRequest(id=job, request=request, created=time.time(), tenant=tenant), status, 1)

    for node, jobs in layout.items():
        lately = time.time() if node == "n2" else 0.0
        for i, job in enumerate(jobs):
            adopt(job, "acme", JobStatus(state="running", node=node, device=i, attempt=1, preempted_at=lately))
    adopt("gang1", "globex", JobStatus(), devices=3)
    adopt("gang2", "globex", JobStatus(), devices=3)
    return core


async def test_free_devices_are_counted_for_one_waiting_gang_only():
    """The first check gives gang1 one of a1 and a2 (with n1's two free devices: room for it); gang2 is not given
    the other as well, in that check or the next ones, while gang1's victim is being paused: n1's free devices are
    gang1's, and the other's device alone makes no room for gang2 (before: a2 too, stopped for nothing)."""
    core = node_half_free_beside_a_young_one()
    table = sharing.shares(core)
    assert (table.share, table.held) == ({"acme": 2, "globex": 6}, {"acme": 6, "globex": 0}), table
    preemption = Preemption(core, Pausing(core))
    try:
        for _ in range(3):
            preemption.check()
        chosen = sorted((v, f.waiting) for v, f in preemption.in_flight.items())
        assert len(chosen) == 1 and chosen[0][0] in ("a1", "a2"), chosen
    finally:
        for task in list(core.tasks):
            task.cancel()
        await asyncio.gather(*core.tasks, return_exceptions=True)
