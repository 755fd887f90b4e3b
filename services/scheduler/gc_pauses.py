"""What Python's garbage collector costs the scheduler's loop, and what keeps it short.

Each collection holds the loop; a full one walks every object the process tracks: at 1,000 nodes and 10,000 jobs
that took 120-190 ms, whichever pass or lease renewal it landed in (and freezing only what survived full
collections still left 64 ms: 10,000 jobs arrive within seconds). So while a scheduler leads, whatever survives a
collection of the older generations (the jobs, the fleet's views, everything that lives as long as it leads) is
moved out of the collector's sight at once (gc.freeze), and so is what its start-up took into memory: collections
walk only what is young. Those objects are freed by their reference counts as always; only a reference cycle among
them would outlive its use (a full run of bench/fair_share.py found 127 such objects), so while nothing waits and no
complete collection ran for RELEASE_S, or after RELEASE_MAX_S whatever waits, everything is collected once and
frozen again.

Young collections by the clock. CPython starts a young collection when allocations less deallocations of tracked
objects pass 700, and a deallocation counts whichever generation the object was in: a scheduler that replaces each
node's last heartbeat (39 tracked objects, the one it replaces frozen long ago) allocates about as much as it frees,
so the count stays near zero while every heartbeat since the last collection piles up in the young generation (50,000
young objects and a count of 2, measured), and the collection that comes at last walks all of them: 15-21 ms of CPU
at 1,000 nodes in bench/fair_share.py. So while a scheduler leads, the young generation is collected every YOUNG_S
whatever the count says, and what survives is frozen at once (it lives at least as long as a node's heartbeat
interval, or as long as a job): each collection walks what YOUNG_S brought, never the piled-up seconds.

GcPauses counts the collections of each generation and the longest while a scheduler leads (its closing line;
bench/fair_share.py and bench/control_plane.py read it beside the longest placement pass), and `spent_s()` the time
all collections took, so a placement pass can tell its own time from the collector's."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import Counter
from collections.abc import Callable

from services.aio import sleep_unless_stopped

log = logging.getLogger(__name__)
RELEASE_S = 600.0  # a complete collection (frozen objects too) at most this often, and only while nothing waits
RELEASE_MAX_S = 3600.0  # and at least this often, whatever waits
QUIET_CHECK_S = 5.0
YOUNG_S = 0.05  # the young generation is collected (and its survivors frozen) this often while leading
_spent = [0.0]  # seconds all collections took, since the process began
_began = [0.0]


def _clock(phase: str, info: dict) -> None:
    if phase == "start":
        _began[0] = time.perf_counter()
        return
    _spent[0] += time.perf_counter() - _began[0]


gc.callbacks.append(_clock)


def spent_s() -> float:
    """Seconds spent collecting since the process began (a pass subtracts its start's from its end's)."""
    return _spent[0]


class GcPauses:
    """A gc.callbacks hook while a scheduler leads (`with`): collections by generation, the longest of each, and
    what the full ones found; after each collection of the older generations, what survived it is frozen (it lives
    long: no full collection need walk it). When the leading ends, everything frozen goes back to the collector (a
    process that goes on, a test's, keeps no cycle for good)."""

    def __init__(self) -> None:
        self.count: Counter[int] = Counter()
        self.longest_s: dict[int, float] = {0: 0.0, 1: 0.0, 2: 0.0}
        self.longest_cpu_s: dict[int, float] = {0: 0.0, 1: 0.0, 2: 0.0}  # the CPU time of each generation's longest
        self.longest_found: dict[int, int] = {0: 0, 1: 0, 2: 0}  # and the objects it found in cycles (and freed)
        self.unreachable = 0  # objects full collections found in reference cycles (what freezing would keep)
        self._began = self._began_cpu = 0.0
        self._young: asyncio.TimerHandle | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began, self._began_cpu = time.perf_counter(), time.thread_time()
            return
        took, generation = time.perf_counter() - self._began, info.get("generation", 2)
        self.count[generation] += 1
        if took > self.longest_s.get(generation, 0.0):
            self.longest_s[generation] = took
            self.longest_cpu_s[generation] = time.thread_time() - self._began_cpu
            self.longest_found[generation] = info.get("collected", 0) + info.get("uncollectable", 0)
        if generation == 2:
            self.unreachable += info.get("collected", 0) + info.get("uncollectable", 0)
        if generation >= 1:  # what survived two collections lives long: no full collection need walk it
            gc.freeze()

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self)
        with contextlib.suppress(RuntimeError):  # no loop runs (a test's): the count alone starts collections
            self._young = asyncio.get_running_loop().call_later(YOUNG_S, self._collect_young)
        return self

    def __exit__(self, *_) -> None:
        if self._young is not None:
            self._young.cancel()
            self._young = None
        if self in gc.callbacks:
            gc.callbacks.remove(self)
        gc.unfreeze()

    def _collect_young(self) -> None:
        """Collect the young generation, freeze what survived it, and come back in YOUNG_S."""
        gc.collect(0)
        gc.freeze()
        self._young = asyncio.get_running_loop().call_later(YOUNG_S, self._collect_young)

    def line(self) -> str:
        """The closing line's words."""
        return (
            f"{self.count[2]} full collections (the longest {self.longest_s[2] * 1000:.1f} ms), {self.count[1]} of "
            f"generation 1 (the longest {self.longest_s[1] * 1000:.1f} ms), {self.count[0]} young (the longest "
            f"{self.longest_s[0] * 1000:.1f} ms); {self.unreachable} objects found in cycles by full collections; the "
            f"longest of each generation took {', '.join(f'{self.longest_cpu_s[g] * 1000:.1f}' for g in (2, 1, 0))} "
            f"ms of CPU (the rest: the process waited for a core) and found "
            f"{', '.join(str(self.longest_found[g]) for g in (2, 1, 0))} objects in cycles"
        )


def hold_off() -> bool:
    """Keep the count's collections out of what follows (a placement pass: its budget is its own work); the timer's
    (GcPauses) and those the count asks for once `let_go` is called still come, between passes. Whether they
    were on."""
    was = gc.isenabled()
    gc.disable()
    return was


def let_go(was: bool) -> None:
    """After `hold_off`: the count's collections come again (the one now due at the next allocation)."""
    if was:
        gc.enable()


def settle_after_start() -> None:
    """After a leader's start-up (the store's jobs taken into memory): collect once, then keep what survived out of
    later collections' walk."""
    gc.collect()
    gc.freeze()


async def release_when_quiet(quiet: Callable[[], bool], stop: asyncio.Event) -> None:
    """Every RELEASE_S at most, once `quiet()` (nothing waits), and every RELEASE_MAX_S whatever waits: collect
    everything, frozen objects too, so that no reference cycle among them outlives its use; then freeze what is left
    again."""
    released = time.monotonic()
    while not await sleep_unless_stopped(stop, QUIET_CHECK_S):
        since = time.monotonic() - released
        if since < RELEASE_S or (since < RELEASE_MAX_S and not quiet()):
            continue
        started = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        released = time.monotonic()
        log.info(
            "garbage collection: a complete collection (%s) took %.0f ms and found %d objects in cycles",
            "while nothing waits" if quiet() else f"none for {since / 60:.0f} minutes",
            (time.perf_counter() - started) * 1000,
            found,
        )
