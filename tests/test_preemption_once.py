"""A waiting job is given victims once (#62): while the victims chosen for it are being paused (and until the node's
next heartbeat shows their devices free), the preemption check does not choose more for it. In bench/fair_share.py
a multi-device job of globex's, its node already partly free, was given one more of acme's jobs at every check
until the first one's device showed free: over half the victims of a run were such repeats. On a scheduler's
memory projected from statuses and heartbeats (nothing is sent: the check's choices are what is looked at)."""

from __future__ import annotations

from services.scheduler import sharing
from services.scheduler.core import SchedulerCore
from tests.harness.projected import checking, projected_core, queued, running


def fleet_with_a_gang_waiting() -> SchedulerCore:
    """n1 and n2 (4 devices each) have three free and one of acme's jobs each; n3's four devices hold four more of
    acme's. globex (weight 3) waits with a 4-device job and six 1-device ones: its share is 9 of 12, acme's 3 (it
    holds 6, and waits with six more). Either of n1's or n2's acme job, stopped, makes room for the 4-device job."""
    core = projected_core({"globex": 3})
    layout = {"n1": ["a1"], "n2": ["a2"], "n3": ["a3", "a4", "a5", "a6"]}
    for node, jobs in layout.items():
        running(core, node, [(job, "acme") for job in jobs])
    for i in range(6):
        queued(core, f"q{i}", "acme")
    queued(core, "gang", "globex", devices=4)
    for i in range(6):
        queued(core, f"g{i}", "globex")
    return core


async def test_a_waiting_job_is_given_victims_once_while_they_are_paused():
    """The first check chooses one of acme's jobs on n1 or n2 for globex's 4-device job; the checks after it, the
    victim still being paused (its node's heartbeat still lists it running), choose nobody more for that job
    (before: the other of n1's and n2's jobs at the next check, and more while there were any)."""
    core = fleet_with_a_gang_waiting()
    table = sharing.shares(core)
    assert (table.share, table.held) == ({"acme": 3, "globex": 9}, {"acme": 6, "globex": 0})
    async with checking(core) as preemption:
        preemption.check()
        first = dict(preemption.in_flight)
        assert len(first) == 1 and next(iter(first)) in ("a1", "a2"), first
        assert first[next(iter(first))].waiting == "gang"
        for _ in range(3):
            preemption.check()
        assert preemption.in_flight.keys() == first.keys(), preemption.in_flight
        assert preemption.stats["victims"] == 1


def fleet_of_mixed_nodes() -> SchedulerCore:
    """n1-n3 (4 devices each) hold two of acme's jobs and two of initech's each. Weights acme 1, globex 5, initech 6:
    shares acme 1 (it holds 6), globex 5 (it waits with two 4-device jobs, then a 1-device one), initech 6 (it
    holds 6: none of its jobs may be taken). No node can be freed for a 4-device job without initech's."""
    core = projected_core({"globex": 5, "initech": 6})
    for n in ("n1", "n2", "n3"):
        running(core, n, [(f"{t}-{n}-{i}", t) for t, i in (("acme", 0), ("acme", 1), ("initech", 2), ("initech", 3))])
    queued(core, "gang-a", "globex", devices=4)
    queued(core, "gang-b", "globex", devices=4)
    queued(core, "single", "globex")
    return core


async def test_a_gang_shape_that_found_no_victims_is_not_searched_again_within_a_heartbeat():
    """globex's two 4-device jobs find no victims (each node's would take initech below its share): one search for
    both, and none again in the checks within a heartbeat interval (each reads up to 256 running jobs: 4-5 ms at
    1,000 nodes, so two at a tenant's head took every check's time in bench/fair_share.py); the 1-device job behind
    them is given one of acme's jobs at the first check."""
    core = fleet_of_mixed_nodes()
    table = sharing.shares(core)
    assert table.share == {"acme": 1, "globex": 5, "initech": 6}, table.share
    async with checking(core) as preemption:
        for _ in range(3):
            preemption.check()
        assert preemption.stats["unfound"] == 1, preemption.stats
        chosen = [(f.waiting, f.frm) for f in preemption.in_flight.values()]
        assert chosen == [("single", "acme")], preemption.in_flight
