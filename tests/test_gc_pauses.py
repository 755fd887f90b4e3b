"""The scheduler's account of the garbage collector's pauses while it leads (services/scheduler/gc_pauses.py)."""

import gc

from services.scheduler.gc_pauses import GcPauses


def test_each_generations_longest_pause_is_told_with_the_cpu_it_took():
    """A collection's wall time includes the time the process waited for a core (2 busy cores: a 38 ms young
    collection took 18 ms of CPU); the closing line says both, and what survived is frozen until leading ends."""
    kept = [[i] for i in range(10_000)]  # something for the collection to walk
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
    from services.scheduler.placer import PassStats

    stats = PassStats()
    stats.passed(0.030, 0.0, 0.004)
    stats.passed(0.012, 0.0, 0.012)
    stats.passed(0.002, 0.0, 0.002)
    assert (stats.passes, stats.cut_short, stats.cpu_cut_short) == (3, 2, 1)
    assert (stats.longest_s, stats.longest_cpu_s) == (0.030, 0.004)
