"""A fair share that holds for every shape of job (#62). On the real stack (nats-server, scheduler, artifact service,
agents running the stand-in trainer, which checkpoints at its step when paused): jobs pinned to a node take their
turn within their tenant's share and ask for preemption as others do; a job its tenant is not owed hides nobody
behind it; a node kept for a multi-device job keeps no tenant below its share from an idle device; a set of victims
never takes their tenant below its share. On a scheduler's memory projected from statuses (the co-training group's
members, whose memory the stand-in does not model): a group's members given up for a job that may join it come from
tenants over their shares only."""

from __future__ import annotations

import time

from services.scheduler.config import TenantQuota
from services.scheduler.service import Scheduler
from tests.conftest import at_step, get_job, wait_for, wait_nodes, wait_state
from tests.harness.projected import NoBus
from tests.test_fair_share import past_min_run, shares_of, start, submit_as

HOLD = {"HOLD_STEPS": "600"}  # 60 s jobs (the stand-in's default hold_s below) in steps of 0.1 s


async def under_way(nc, sched: Scheduler, jobs: list[str]) -> None:
    """Until each job has taken a step and run the scheduler's --min-run-s: from then on it may be preempted."""
    for job in jobs:
        await wait_for(lambda j=job: at_step(nc, j, 1), timeout=30, what=f"{job} under way")
    await past_min_run(sched, jobs)


async def quiet_checks(sched: Scheduler, count: int = 8) -> None:
    """Until the preemption check has looked `count` more times (what it would take, it would have taken by then)."""
    stats = sched.preemption.stats
    checks = stats["checks"]
    await wait_for(lambda: stats["checks"] >= checks + count, timeout=15, what=f"{count} preemption checks")


async def test_pinned_jobs_take_their_turn_within_their_tenants_share(nc, services, agents):
    """acme's jobs pinned to n1 hold its three devices; globex (weight 2: a share of 2) submits a job pinned to n1
    and one any node may take. Both run, each for one of acme's jobs preempted (the pinned one asks for its own),
    and acme's victims, pinned to n1 too and queued ahead of acme's others, do not take the devices back."""
    sched = await start(services, quotas={"globex": TenantQuota(weight=2)})
    agents.start("n1", gpus="4096,4096,4096", hold_s=60.0, env=HOLD)
    await wait_nodes(nc, 1)
    acme = [await submit_as(nc, "acme", node="n1", label=f"acme-{i}") for i in range(3)]
    await under_way(nc, sched, acme)

    pinned = await submit_as(nc, "globex", node="n1")
    anywhere = await submit_as(nc, "globex")
    for job in (pinned, anywhere):
        await wait_state(nc, job, "running", timeout=20)
    await quiet_checks(sched)
    assert await shares_of(nc) == {"acme": (1, 1), "globex": (2, 2)}
    states = sorted([(await get_job(nc, j)).state for j in acme])
    assert states == ["queued", "queued", "running"], states
    assert sched.preemption.stats["victims"] == 2


async def test_a_job_its_tenant_is_not_owed_hides_none_behind_it(nc, services, agents):
    """acme (weight 3) holds all four devices; globex (a share of 1) queues a 2-device job, then a 1-device one. The
    first wants more than globex is owed; the second takes one of acme's devices by preemption all the same."""
    sched = await start(services, quotas={"acme": TenantQuota(weight=3)})
    agents.start("n1", gpus="4096,4096,4096,4096", hold_s=60.0, env=HOLD)
    await wait_nodes(nc, 1)
    acme = [await submit_as(nc, "acme", label=f"acme-{i}") for i in range(4)]
    await under_way(nc, sched, acme)

    big = await submit_as(nc, "globex", devices=2)
    small = await submit_as(nc, "globex")
    await wait_state(nc, small, "running", timeout=20)
    await quiet_checks(sched)
    assert (await get_job(nc, big)).state == "queued"
    assert await shares_of(nc) == {"acme": (3, 3), "globex": (1, 1)}
    assert sched.preemption.stats["victims"] == 1


async def test_a_node_kept_for_a_gang_keeps_no_tenant_below_its_share_from_a_device(nc, services, agents):
    """Two nodes of two devices: acme holds three and queues a 2-device job, for which n2 (one device idle) is kept.
    globex, owed 2 (acme's share is 2 once it waits), takes n2's idle device at once and one of acme's by
    preemption: the kept node keeps only tenants at or over their share, and preemption sees what is kept."""
    sched = await start(services)
    for node in ("n1", "n2"):
        agents.start(node, gpus="4096,4096", hold_s=60.0, env=HOLD)
    await wait_nodes(nc, 2)
    acme = [await submit_as(nc, "acme", label=f"acme-{i}") for i in range(3)]
    await under_way(nc, sched, acme)
    gang = await submit_as(nc, "acme", devices=2)
    await wait_for(lambda: gang in sched.core.gang_holds.values(), what="a node kept for acme's 2-device job")

    globex = [await submit_as(nc, "globex", label=f"globex-{i}") for i in range(2)]
    for job in globex:
        await wait_state(nc, job, "running", timeout=20)
    await quiet_checks(sched)
    assert await shares_of(nc) == {"acme": (2, 2), "globex": (2, 2)}
    assert sched.preemption.stats["victims"] == 1
    assert (await get_job(nc, gang)).state == "queued"


async def test_victims_together_never_take_their_tenant_below_its_share(nc, services, agents):
    """n1 holds two of acme's jobs, n2 one of acme's and one of initech's, n3 one of initech's; globex (weight 2:
    a share of 2) queues a 2-device job, and acme and initech are each one device over their shares of 2 and 1.
    Both of n1's jobs would make room, but would take acme to 1: the victims are n2's, one of each tenant."""
    sched = await start(services, quotas={"globex": TenantQuota(weight=2)})
    for node, gpus in (("n1", "4096,4096"), ("n2", "4096,4096"), ("n3", "4096")):
        agents.start(node, gpus=gpus, hold_s=60.0, env=HOLD)
    await wait_nodes(nc, 3)
    layout = [("acme", "n1"), ("acme", "n1"), ("acme", "n2"), ("initech", "n2"), ("initech", "n3")]
    jobs = [
        await submit_as(nc, tenant, node=node, label=f"{tenant}-{node}-{i}") for i, (tenant, node) in enumerate(layout)
    ]
    await under_way(nc, sched, jobs)
    assert await shares_of(nc) == {"acme": (3, 3), "initech": (2, 2), "globex": (0, 0)}  # globex has a quota

    gang = await submit_as(nc, "globex", devices=2)
    running = await wait_state(nc, gang, "running", timeout=20)
    await quiet_checks(sched)
    assert running.node == "n2", running
    assert await shares_of(nc) == {"acme": (2, 2), "initech": (1, 1), "globex": (2, 2)}
    stopped = [job for job, (_, node) in zip(jobs, layout) if (await get_job(nc, job)).state != "running"]
    assert stopped == [jobs[2], jobs[3]], stopped  # n2's: one of acme's, one of initech's
    assert sched.preemption.stats["victims"] == 2


def co_trained_fleet():
    """A core under --co-train any (min-run 0) projected from statuses: n1's device 0 (81,920 MiB, 10,000 free) holds
    a group of acme's m0 and m1 and globex's x0 (20,000 MiB each; x0 the newest, of the lowest priority: the member
    the group would give up first), devices 1-3 (16,384 MiB) one of acme's jobs each; initech's job needing 25,000
    MiB waits. Shares of 4 devices: acme 2 (it holds 4), globex 1 (it holds 1), initech 1 (it holds none)."""
    from schemas.jobs import JobRequest
    from schemas.job_status import JobStatus, StoredRequest
    from schemas.nodes import Device, Heartbeat, RunningAttempt
    from services.scheduler.core import SchedulerConfig, SchedulerCore

    core = SchedulerCore(NoBus(), SchedulerConfig(co_train="any", min_run_s=0.0))  # type: ignore[arg-type]
    group = [("m0", "acme", 0), ("m1", "acme", 0), ("x0", "globex", -1)]
    alone = [(f"a{i}", "acme", i) for i in (1, 2, 3)]
    attempts = [RunningAttempt(job=j, attempt=1, devices=[0], state="running", group="g") for j, _, _ in group]
    attempts += [RunningAttempt(job=j, attempt=1, devices=[i], state="running") for j, _, i in alone]
    devices = [Device(index=0, total_mib=81920, free_mib=10000, jobs=[j for j, _, _ in group])]
    devices += [Device(index=i, total_mib=16384, free_mib=0, jobs=[j]) for j, _, i in alone]
    core.fleet.heard(Heartbeat(node="n1", agent_version="t", devices=devices, attempts=attempts))

    def adopt(job: str, tenant: str, gpu_mib: int, status: JobStatus, priority: int = 0):
        request = JobRequest(model="m", base_dir="/models/m", gpu_mib=gpu_mib, priority=priority)
        return core.adopt(StoredRequest(id=job, request=request, created=time.time(), tenant=tenant), status, 1)

    for job, tenant, priority in group:
        adopt(job, tenant, 20000, JobStatus(state="running", node="n1", device=0, group="g", attempt=1), priority)
    for job, tenant, device in alone:
        adopt(job, tenant, 16000, JobStatus(state="running", node="n1", device=device, attempt=1))
    adopt("w", "initech", 25000, JobStatus())
    return core


async def test_a_groups_members_given_up_come_from_tenants_over_their_share():
    """initech's job may join the group (--co-train any): a member's memory makes its room there. The member given
    up is acme's (over its share), not globex's (at its share), although globex's would lose least."""
    from services.scheduler import sharing
    from tests.harness.projected import checking

    core = co_trained_fleet()
    table = sharing.shares(core)
    assert (table.share, table.held) == ({"acme": 2, "globex": 1, "initech": 1}, {"acme": 4, "globex": 1, "initech": 0})
    async with checking(core) as preemption:  # the pauses it sends have no node to go to here
        preemption.check()
        chosen = {victim: f.frm for victim, f in preemption.in_flight.items()}
        assert len(chosen) == 1 and set(chosen.values()) == {"acme"}, chosen
        assert next(iter(chosen)) in ("m0", "m1"), chosen


def test_the_share_watch_times_each_wait_for_a_device_while_another_holds_more():
    """globex (owed 2, one job of one device waiting) gains a device after 5 s, reaches its share 1.5 s later: the
    longest wait for a device is 5 s (the one past the allowance of --min-run-s 1 s + a 1 s heartbeat window), the
    longest below its share 6.5 s; a tenant below its share with nobody over theirs waits for nothing; a wait under
    way when the scheduler stops leading is not carried into its next term."""
    from schemas.job_status import JobStatus
    from services.scheduler.core import SchedulerConfig, SchedulerCore
    from services.scheduler.share_watch import ShareWatch
    from services.scheduler.sharing import ShareTable

    core = SchedulerCore(NoBus(), SchedulerConfig(min_run_s=1.0, heartbeat_interval=0.25, misses=4))  # type: ignore[arg-type]
    core.book.count("w", "globex", 1, None, JobStatus(), 1)
    watch = ShareWatch(core)

    def shares(globex: int, acme: int) -> ShareTable:
        return ShareTable(4, {"acme": 2, "globex": 2}, {"acme": acme, "globex": globex}, {})

    for now, globex, acme in ((0.0, 0, 4), (5.0, 1, 3), (6.0, 1, 3), (6.5, 2, 2), (9.0, 1, 2)):
        watch.observe(shares(globex, acme), now=now)
    assert (watch.longest, watch.longest_below, watch.logged) == ((5.0, "globex"), (6.5, "globex"), 1)
    assert watch.waiting == {}  # below its share at 9 s, but nobody holds more than theirs
    watch.observe(shares(0, 4), now=10.0)  # a wait begins; the scheduler stops leading, and leads again 100 s later
    watch.restart()
    watch.observe(shares(0, 4), now=110.0)
    watch.observe(shares(1, 3), now=111.0)
    assert (watch.longest, watch.logged) == ((5.0, "globex"), 1)  # 1 s of this term, not 101 s


def test_a_wait_for_a_device_ends_only_when_the_scheduler_acts_for_the_tenant():
    """initech (share 8, holding 4) has its short jobs end and replaced one for one, a look falling between each end
    and its replacement, while acme holds more than its share and nothing is preempted: one wait, however the looks
    fall (the rule before, "more than the fewest it held since", took each replacement for a gain, so a scheduler
    that never preempted passed: a review's finding); preemption planning devices for it begins a new wait, and so
    does holding more than it ever held in the wait; the log line says what the wait held."""
    from schemas.job_status import JobStatus
    from services.scheduler.core import SchedulerConfig, SchedulerCore
    from services.scheduler.share_watch import ShareWatch
    from services.scheduler.sharing import ShareTable

    core = SchedulerCore(NoBus(), SchedulerConfig(min_run_s=1.0, heartbeat_interval=0.25, misses=4))  # type: ignore[arg-type]
    core.book.count("w", "initech", 1, None, JobStatus(), 1)
    watch = ShareWatch(core)

    def shares(initech: int) -> ShareTable:
        return ShareTable(16, {"acme": 8, "initech": 8}, {"acme": 12, "initech": initech}, {})

    for now, initech in ((0.0, 4), (1.5, 2), (3.0, 4), (6.0, 3), (9.0, 4), (10.0, 3), (11.0, 4)):
        watch.observe(shares(initech), now=now)
    assert watch.longest_now(now=11.0)[0] == (11.0, "initech") and watch.logged == 0  # one wait, under way
    watch.planned["initech"] += 2  # preemption plans two devices for it (preemption.py counts them here)
    watch.observe(shares(4), now=11.5)
    assert watch.longest == (11.5, "initech") and watch.logged == 1  # the wait past the allowance (2 s), logged
    watch.observe(shares(5), now=12.0)  # more than it held in the wait: a gain
    watch.observe(shares(5), now=13.0)
    assert watch.longest_now(now=13.0)[0] == (11.5, "initech") and watch.waiting["initech"].since == 12.0
