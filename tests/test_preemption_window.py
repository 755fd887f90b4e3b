"""A tenant below its share is not kept from preemption by the multi-device jobs at its queue's head (#62, review):
the check passes over a tenant's waiting job it could not be given, up to MISSES (32) in a row, then leaves that
tenant. A job that asks for more devices than its tenant is owed is not searched at all (no victim could be taken
for it without taking the tenant past its share), yet it counted as one of those misses: 32 such jobs at the head
of a queue hid the 1-device jobs behind them from preemption for good, the tenant below its share, another over it.
On a scheduler's memory projected from statuses and heartbeats (nothing is sent: the check's choices are looked
at), as tests/test_preemption_once.py does."""

from __future__ import annotations

import time

from services.scheduler import sharing
from services.scheduler.core import SchedulerCore
from services.scheduler.preemption import MISSES
from tests.harness.projected import checking, projected_core, queued, running


def fleet_with_big_jobs_first(big: int) -> SchedulerCore:
    """n1 and n2 (4 devices each) run eight of acme's jobs; globex (same weight) waits with `big` 6-device jobs
    (each more than its share of 4), then two 1-device jobs."""
    core = projected_core()
    for node in ("n1", "n2"):
        running(core, node, [(f"a-{node}-{i}", "acme") for i in range(4)])
    for i in range(big):
        queued(core, f"big{i}", "globex", devices=6)
    queued(core, "small0", "globex")
    queued(core, "small1", "globex")
    return core


async def check_small_jobs_get_victims(big: int) -> None:
    core = fleet_with_big_jobs_first(big)
    table = sharing.shares(core)
    assert (table.share, table.held) == ({"acme": 4, "globex": 4}, {"acme": 8, "globex": 0}), table
    async with checking(core) as preemption:
        preemption.check()
        chosen = sorted((f.waiting, f.frm) for f in preemption.in_flight.values())
        assert chosen == [("small0", "acme"), ("small1", "acme")], (big, preemption.in_flight, preemption.stats)


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
    core = projected_core({"globex": 3})
    running(core, "n1", [("a1", "acme"), ("a2", "acme")])
    running(core, "n2", [(f"b{i}", "acme") for i in range(4)], preempted_at=time.time())
    queued(core, "gang1", "globex", devices=3)
    queued(core, "gang2", "globex", devices=3)
    return core


async def test_free_devices_are_counted_for_one_waiting_gang_only():
    """The first check gives gang1 one of a1 and a2 (with n1's two free devices: room for it); gang2 is not given
    the other as well, in that check or the next ones, while gang1's victim is being paused: n1's free devices are
    gang1's, and the other's device alone makes no room for gang2 (before: a2 too, stopped for nothing)."""
    core = node_half_free_beside_a_young_one()
    table = sharing.shares(core)
    assert (table.share, table.held) == ({"acme": 2, "globex": 6}, {"acme": 6, "globex": 0}), table
    async with checking(core) as preemption:
        for _ in range(3):
            preemption.check()
        chosen = sorted((v, f.waiting) for v, f in preemption.in_flight.items())
        assert len(chosen) == 1 and chosen[0][0] in ("a1", "a2"), chosen
