"""The scheduler's account of the garbage collector's pauses while it leads (services/scheduler/gc_pauses.py)."""

import gc

from services.scheduler.gc_pauses import GcPauses


def test_each_generations_longest_pause_is_told_with_the_cpu_it_took():
    """A collection's wall time includes the time the process waited for a core (2 busy cores: a 38 ms young
    collection took 18 ms of CPU); the closing line says both, and what survived is frozen until leading ends."""
    kept = [[i] for i in range(10_000)]  # something for the collection to walk
    gc.collect()  # the count from zero: no collection of the count's comes among the cycles below
    with GcPauses() as pauses:
        for _ in range(100):  # a cycle of two for the collection to find and free
            a: list = []
            a.append([a])
        del a
        gc.collect(1)
        assert pauses.longest_found[1] >= 200
        assert pauses.count[1] == 1
        assert 0.0 < pauses.longest_s[1]
        assert 0.0 <= pauses.longest_cpu_s[1] <= pauses.longest_s[1] + 0.002  # thread_time's resolution
        assert gc.get_freeze_count() > 0  # what survived a collection of generation 1 is out of later walks
        assert "ms of CPU" in pauses.line()
    assert gc.get_freeze_count() == 0  # leading ended: everything is the collector's again
    assert len(kept) == 10_000


def test_a_pass_past_its_budget_is_told_apart_from_one_that_waited_for_a_core():
    """A pass of 30 ms wall time that took 4 ms of CPU went past its budget waiting for a core, not working; one of
    12 ms of CPU went past it on its own work."""
    from services.scheduler.pass_stats import PassStats

    stats = PassStats()
    stats.passed(0.030, 0.0, 0.004)
    stats.passed(0.012, 0.0, 0.012)
    stats.passed(0.002, 0.0, 0.002)
    assert (stats.passes, stats.cut_short, stats.cpu_cut_short) == (3, 2, 1)
    assert (stats.longest_s, stats.longest_cpu_s) == (0.030, 0.012)  # the longest by wall, the most CPU any took


async def test_the_young_generation_is_collected_by_the_clock_while_leading():
    """A scheduler replaces each node's heartbeat: it allocates about as much as it frees, and CPython's count
    (allocations less deallocations, whatever generation the freed object was in) stays near zero, so no young
    collection comes while 50,000 young objects pile up for the one that comes at last to walk. While leading they
    are collected within YOUNG_S anyway, and what survived is frozen."""
    import asyncio
    import time

    from services.scheduler.gc_pauses import YOUNG_S

    old = [[i] for i in range(50_000)]
    gc.collect()
    gc.freeze()
    with GcPauses() as pauses:
        young = []
        for i in range(50_000):  # a heartbeat in, the one it replaces out
            young.append([i])
            old[i] = None
        assert gc.get_count()[0] < 700 and len(gc.get_objects(0)) >= 50_000  # no collection was due by the count
        frozen = gc.get_freeze_count()
        deadline = time.monotonic() + 10 * YOUNG_S + 5
        while pauses.count[0] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(YOUNG_S / 5)
        assert pauses.count[0] >= 1
        assert len(gc.get_objects(0)) < 1_000
        walked = {id(o) for o in gc.get_objects()}  # generations 0-2: what a collection walks, the frozen not
        assert not any(id(y) in walked for y in young)  # the survivors were frozen, out of every later walk
        assert gc.get_freeze_count() > frozen  # (by count alone: frozen objects freed meanwhile take a few off it)
    assert len(young) == 50_000


def test_no_collection_the_count_asks_for_lands_in_a_placement_pass():
    """A pass holds the count's collections off (its budget is its own work: a young collection of 2-3 ms had taken a
    pass of 8.0 ms of its own to 10.8 ms of CPU); the one due comes once the pass lets go."""
    from services.scheduler.gc_pauses import hold_off, let_go

    gc.collect()
    with GcPauses() as pauses:
        was = hold_off()
        made = [[i] for i in range(5_000)]  # past the count's 700
        assert pauses.count[0] == 0
        let_go(was)
        made += [[i] for i in range(10)]
        assert pauses.count[0] == 1
    assert gc.isenabled()
