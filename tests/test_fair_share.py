"""Fair sharing: weighted max-min shares (the arithmetic, then the real stack: nats-server, scheduler, artifact
service, agents running the stand-in trainer, which checkpoints at its step when paused and goes on from it). A
tenant below its share takes devices back from one over its share by pausing its jobs with a checkpoint; they are
queued again at once and go on from the step they stopped at; a job that no device could hold preempts nobody."""

from __future__ import annotations

import asyncio
import re
import time
from collections import defaultdict

import pytest

from schemas import names
from schemas.events import StateChange
from schemas.jobs import Accepted
from schemas.job_status import JobQuery, JobReply, JobWhy
from schemas.tenants import TenantList, TenantsQuery
from services import bus
from services.artifacts.service import ArtifactService
from services.cli.watch import describe
from services.gateway.openai_map import fine_tuning_job
from services.scheduler.config import TenantQuota
from services.scheduler.service import Scheduler, SchedulerConfig
from services.scheduler.shares import Claim, fair_shares
from tests.conftest import at_step, get_job, states_of, wait_for, wait_nodes, wait_state
from tests.harness.projected import NoBus
from tests.qa import pairs

JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), "gpu_mib": 1000}
# the stand-in's steps of 0.2 s: 60 (12 s) leave acme's jobs running well past the checks made after globex's start
# even when this process (the scheduler's) stalls for seconds on a busy machine; 30 (6 s) left about 3 s, after
# which acme's victims could be placed again and the shares read changed
STEPS = 60


def claim(demand: int, weight: float = 1, nominal: int = 0, cap: int | None = None, held: int = 0) -> Claim:
    return Claim(weight=weight, nominal=nominal, cap=cap, demand=demand, held=held)


def test_shares_are_weighted_max_min_over_what_each_tenant_wants():
    assert fair_shares(4, {"a": claim(4), "b": claim(2)}) == {"a": 2, "b": 2}
    assert fair_shares(8000, {"a": claim(10_000), "b": claim(3000), "c": claim(400, weight=2)}) == {
        "a": 4600,
        "b": 3000,
        "c": 400,
    }  # b and c want less than their level: a gets the rest
    assert fair_shares(9, {"a": claim(100, weight=2), "b": claim(100)}) == {"a": 6, "b": 3}
    assert fair_shares(4, {"a": claim(1), "b": claim(0)}) == {"a": 1, "b": 0}  # nobody gets more than it wants
    assert fair_shares(0, {"a": claim(3)}) == {"a": 0}


def test_nominal_devices_come_first_and_borrowing_stops_at_its_limit():
    # a's 6 nominal are guaranteed; the 4 left go 1:5 by weight (b's 3.33 rounds down, a's 0.67 up)
    assert fair_shares(10, {"a": claim(10, nominal=6), "b": claim(10, weight=5)}) == {"a": 7, "b": 3}
    # nominal promised beyond the fleet: the nominal devices themselves are shared by weight
    assert fair_shares(10, {"a": claim(10, nominal=8), "b": claim(10, nominal=8)}) == {"a": 5, "b": 5}
    # a may borrow 2 beyond its nominal 0: b gets the rest although it wants only 3 at its level
    assert fair_shares(10, {"a": claim(10, cap=2), "b": claim(3)}) == {"a": 2, "b": 3}


def test_a_device_left_over_stays_with_the_tenant_holding_it():
    """Three devices, two equal tenants: the odd one goes to whoever holds it now, so shares do not flip."""
    assert fair_shares(3, {"a": claim(9, held=3), "b": claim(9)}) == {"a": 2, "b": 1}
    assert fair_shares(3, {"a": claim(9), "b": claim(9, held=2)}) == {"a": 1, "b": 2}


def test_the_quota_takes_weight_borrow_and_preempt():
    q = TenantQuota.parse("devices:2,weight:2.5,borrow:4,preempt:own")
    assert (q.nominal, q.weight, q.borrow, q.preempt_own) == (2, 2.5, 4, True)
    assert q.cap("fair") == 6 and q.cap("fifo") == 2  # fifo: devices is a cap, as it always was
    assert TenantQuota.parse("devices:2").cap("fair") is None  # no borrow limit: it may take what is idle
    for bad in ("weight:0", "weight:-1", "weight:x", "weight:nan", "borrow:-1", "preempt:all"):
        with pytest.raises(ValueError, match="weight:W,borrow:B,preempt:own"):
            TenantQuota.parse(bad)


async def start(services, **config) -> Scheduler:
    cfg = SchedulerConfig(
        co_train="off", heartbeat_interval=0.25, misses=4, min_run_s=1.0, preempt_backoff_s=60.0, **config
    )
    sched, *_ = await services.start(lambda c: Scheduler(c, cfg))
    await services.start(lambda c: ArtifactService(c))
    await asyncio.wait_for(sched.leading.wait(), 10)
    return sched


async def submit_as(nc, tenant: str, **job) -> str:
    reply = await bus.request(nc, names.jobs_api(tenant).submit, {**JOB, **job}, Accepted)
    return reply.job


async def shares_of(nc) -> dict[str | None, tuple[int, int]]:
    reply = await bus.request(nc, names.TENANTS, TenantsQuery(), TenantList)
    return {t.tenant: (t.fair_share, t.in_use) for t in reply.tenants}


async def past_min_run(sched: Scheduler, jobs: list[str]) -> None:
    """Until each job has run the scheduler's --min-run-s (1 s here): from then on it may be preempted."""
    running, least = sched.core.book.running.jobs, sched.cfg.min_run_s

    def old_enough() -> bool:
        return all(j in running and time.monotonic() - running[j].started >= least for j in jobs)

    await wait_for(old_enough, timeout=20, what=f"{jobs} running {least} s")


def steps_by_attempt(log_text: str) -> dict[str, dict[int, list[int]]]:
    """job -> attempt -> the steps it computed, in order (from the stand-in trainer's HOLD_LOG)."""
    out: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for line in log_text.splitlines():
        job, attempt, step, *_ = line.split()
        out[job][int(attempt)].append(int(step))
    return out


async def test_a_tenant_below_its_share_takes_two_devices_back_by_checkpoint(nc, services, agents, tmp_path):
    sched = await start(services)
    log = tmp_path / "steps.log"
    for node in ("n1", "n2"):  # four devices on two nodes: a preempted job may go on on the other node
        agents.start(node, gpus="4096,4096", hold_s=STEPS * 0.2, env={"HOLD_LOG": str(log), "HOLD_STEPS": str(STEPS)})
    await wait_nodes(nc, 2)
    acme = [await submit_as(nc, "acme", label=f"acme-{i}") for i in range(4)]
    for job in acme:  # acme alone: it borrows the whole fleet
        await wait_for(lambda j=job: at_step(nc, j, 3), timeout=30, what=f"acme's {job} under way")
    assert await shares_of(nc) == {"acme": (4, 4)}

    globex = [await submit_as(nc, "globex", label=f"globex-{i}") for i in range(2)]
    for job in globex:  # within seconds, two of acme's jobs checkpoint and globex's run
        await wait_state(nc, job, "running", timeout=15)
    assert await shares_of(nc) == {"acme": (2, 2), "globex": (2, 2)}
    preempted = [j for j in acme if (await get_job(nc, j)).preempted]
    assert len(preempted) == 2, [await get_job(nc, j) for j in acme]
    # the second victim, chosen once the first's device is on its way to globex, counts it: 0 or 1 of 2
    why = re.compile(r"preempted: tenant globex below its fair share \([01] of 2 devices\)")
    for job in preempted:  # queued again at once, saying who took its device and why
        summary = await get_job(nc, job)
        assert summary.state == "queued" and why.match(summary.message), summary
        assert fine_tuning_job(summary, None).status == "paused"  # as OpenAI's clients see a pause
        told = await bus.request(nc, names.WHY, JobQuery(job), JobWhy)
        assert why.match(told.summary) and "holds 2 devices, its fair share is 2" in told.summary, told

    for job in globex:
        assert (await wait_state(nc, job, "succeeded", timeout=30)).attempt == 1
    for job in acme:  # once globex's end, acme's go on from the step they stopped at
        assert (await wait_state(nc, job, "succeeded", timeout=60)).state == "succeeded"
    steps = steps_by_attempt(log.read_text())
    for job in acme:
        ran = steps[job]
        assert sorted(s for attempt in ran.values() for s in attempt) == list(range(1, STEPS + 1)), (job, ran)
        if job in preempted:  # attempt 1 stopped at its checkpoint, attempt 2 took the next step
            events = await states_of(nc, job)
            paused = [e for e in events if e.state == "paused"]
            assert len(paused) == 1 and why.fullmatch(paused[0].paused_by or ""), paused  # once, not again
            assert describe(paused[0]).endswith(f"(by {paused[0].paused_by})")  # as `jetlora events` shows it
            [saved] = [e.checkpoint.step for e in events if e.checkpoint is not None and e.attempt == 1]
            assert ran[1][-1] == saved and ran[2][0] == saved + 1, (saved, ran)
        else:
            assert list(ran) == [1], ran
    assert sched.preemption.stats["victims"] == 2


async def test_a_waiting_job_that_fits_nowhere_preempts_nobody(nc, services, agents):
    """Devices of 4096 MiB with 2000 free (the rest is the serving engine's): acme's 1000 MiB jobs hold both; a job
    of globex's needing 3500 MiB would not fit even where acme's job stopped, so nothing is preempted for it. A
    globex job that would fit does preempt, once: the difference is the fit."""
    sched = await start(services)
    agents.start("n1", gpus="4096/2000,4096/2000", hold_s=30.0)
    await wait_nodes(nc, 1)
    acme = [await submit_as(nc, "acme") for _ in range(2)]
    for job in acme:
        await wait_for(lambda j=job: at_step(nc, j, 1), timeout=30, what=f"acme's {job} under way")
    await past_min_run(sched, acme)  # from here on acme's jobs may be preempted
    big = await submit_as(nc, "globex", gpu_mib=3500)
    checks = sched.preemption.stats["checks"]
    await wait_for(lambda: sched.preemption.stats["checks"] >= checks + 8, timeout=10, what="eight preemption checks")
    assert sched.preemption.stats["victims"] == 0
    for job in acme:
        running = await get_job(nc, job)
        assert running.state == "running" and running.attempt == 1, running
    assert (await get_job(nc, big)).state == "queued"

    fits = await submit_as(nc, "globex", gpu_mib=1000)
    await wait_state(nc, fits, "running", timeout=15)
    assert sched.preemption.stats["victims"] == 1
    reply = await bus.request(nc, names.jobs_api("globex").job, JobQuery(big), JobReply)
    assert reply.job.state == "queued"


async def test_a_tenant_may_let_its_urgent_jobs_preempt_its_own(nc, services, agents):
    """preempt:own: acme's priority-5 job takes the device of acme's own priority-0 job; globex's tenant, without
    it, only waits. fifo sharing preempts nothing (tests/test_tenants.py keeps its behaviour)."""
    sched = await start(services, quotas={"acme": TenantQuota(devices=1, borrow=0, priority=5, preempt_own=True)})
    agents.start("n1", gpus="4096,4096", hold_s=30.0)
    await wait_nodes(nc, 1)
    low = await submit_as(nc, "acme")
    other = await submit_as(nc, "globex")
    for job in (low, other):
        await wait_for(lambda j=job: at_step(nc, j, 1), timeout=30, what=f"{job} under way")
    await past_min_run(sched, [low, other])
    urgent = await submit_as(nc, "acme", priority=5)
    await wait_state(nc, urgent, "running", timeout=15)
    moved = await get_job(nc, low)
    assert moved.state == "queued" and "preempt:own" in moved.preempted, moved
    assert (await get_job(nc, other)).attempt == 1  # another tenant's job is not its to take
    states = [e for e in await states_of(nc, low) if isinstance(e, StateChange) and e.state == "paused"]
    assert len(states) == 1 and sched.preemption.stats["victims"] == 1


def group_of_three(policy: str):
    """A core whose fleet is one 81,920 MiB device with 10,000 MiB free, held by a co-training group of three of
    acme's jobs (20,000 MiB each), and a queued job of globex's needing 25,000 MiB."""
    from schemas.jobs import JobRequest
    from schemas.job_status import JobStatus, StoredRequest
    from schemas.nodes import Device, Heartbeat, RunningAttempt
    from services.scheduler.core import SchedulerCore

    core = SchedulerCore(NoBus(), SchedulerConfig(co_train=policy))  # type: ignore[arg-type]
    members = ["m0", "m1", "m2"]
    attempts = [RunningAttempt(job=j, attempt=1, devices=[0], state="running", group="g") for j in members]
    device = Device(index=0, total_mib=81920, free_mib=10000, jobs=members)
    core.fleet.heard(Heartbeat(node="n1", agent_version="t", devices=[device], attempts=attempts))

    def adopt(job: str, tenant: str, gpu_mib: int, status: JobStatus):
        request = JobRequest(model="m", base_dir="/models/m", gpu_mib=gpu_mib)
        return core.adopt(StoredRequest(id=job, request=request, created=time.time(), tenant=tenant), status, 1)

    for j in members:
        adopt(j, "acme", 20000, JobStatus(state="running", node="n1", device=0, group="g", attempt=1))
    return core, members, adopt("w", "globex", 25000, JobStatus())


def test_a_group_gives_up_the_fewest_members_a_joiner_needs_and_all_for_one_that_may_not_join():
    from services.scheduler.victims import VictimSearch

    # --co-train any: globex's job may join acme's group, and one member's memory makes its room there
    core, members, waiting = group_of_three("any")
    plan = VictimSearch(core, waiting, lambda v: True).first(core.book.running.of("acme"), lambda t, n: True)
    assert plan is not None and len(plan.victims) == 1 and plan.frees == {"acme": 0}, plan  # the group keeps its device
    # same-tenant: it may not join acme's group; the device frees only when all three stop
    core, members, waiting = group_of_three("same-tenant")
    plan = VictimSearch(core, waiting, lambda v: True).first(core.book.running.of("acme"), lambda t, n: True)
    assert plan is not None and sorted(v.id for v in plan.victims) == members and plan.frees == {"acme": 1}, plan
    # ... and not at all when one of them may not be preempted (too young, say)
    search = VictimSearch(core, waiting, lambda v: v.id != "m1")
    assert search.first(core.book.running.of("acme"), lambda t, n: True) is None
