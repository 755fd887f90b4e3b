"""A tenant's 1-device jobs are not hidden from idle devices by its multi-device jobs that fit nowhere (#62): the
placement pass gives up on a queue after the backfill window of jobs that did not fit, and in bench/fair_share.py
acme's ~100 8-device jobs at the head of its queue (no node had eight free) used the window up in every pass, so
its 259 1-device jobs behind them stayed queued for 2.5 s beside 400-750 idle devices (utilisation while jobs
waited fell to 0.80). A gang of a shape that found no room in the pass is passed over at no cost, not counted. On
the real stack (nats-server, scheduler, artifact service, agents running the stand-in trainer)."""

from __future__ import annotations

from services.scheduler.config import TenantQuota
from tests.conftest import get_job, wait_for, wait_nodes, wait_state
from tests.test_fair_share import start, submit_as
from tests.test_fair_share_shapes import HOLD


async def test_one_device_jobs_behind_more_gangs_than_the_window_take_an_idle_device(nc, services, agents):
    """Two nodes of two devices, one busy on each (jobs pinned there); acme queues three 2-device jobs of priority
    1 (none fits: no node has two free; n1 or n2 is kept for the first), then a 1-device job. With a backfill window
    of 2 the 1-device job runs on the idle device of the node not kept (before: the first two gangs used the window
    up and it waited until a job ended, 60 s)."""
    sched = await start(services, backfill_window=2, quotas={"acme": TenantQuota(priority=1)})
    for node in ("n1", "n2"):
        agents.start(node, gpus="4096,4096", hold_s=60.0, env=HOLD)
    await wait_nodes(nc, 2)
    for node in ("n1", "n2"):
        await wait_state(nc, await submit_as(nc, "acme", node=node, label=f"busy-{node}"), "running", timeout=20)
    gangs = [await submit_as(nc, "acme", devices=2, priority=1, label=f"gang-{i}") for i in range(3)]
    await wait_for(lambda: bool(sched.core.gang_holds), what="a node kept for acme's first 2-device job")
    single = await submit_as(nc, "acme", label="single")
    running = await wait_state(nc, single, "running", timeout=15)
    assert running.node not in sched.core.gang_holds, (running.node, sched.core.gang_holds)
    for gang in gangs:
        assert (await get_job(nc, gang)).state == "queued"
