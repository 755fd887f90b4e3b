"""The scheduler's account of the garbage collector's pauses while it leads (services/scheduler/gc_pauses.py)."""

import gc

from services.scheduler.gc_pauses import GcPauses


def test_each_generations_longest_pause_is_told_with_the_cpu_it_took():
    """A collection's wall time includes the time the process waited for a core (2 busy cores: a 38 ms young
    collection took 18 ms of CPU); the closing line says both, and what survived is frozen until leading ends."""
    kept = [[i] for i in range(10_000)]  # something for the collection to walk
    with GcPauses() as pauses:
        gc.collect(1)
        assert pauses.count[1] == 1
        assert 0.0 < pauses.longest_s[1]
        assert 0.0 <= pauses.longest_cpu_s[1] <= pauses.longest_s[1] + 0.002  # thread_time's resolution
        assert gc.get_freeze_count() > 0  # what survived a collection of generation 1 is out of later walks
        assert "ms of CPU" in pauses.line()
    assert gc.get_freeze_count() == 0  # leading ended: everything is the collector's again
    assert len(kept) == 10_000
