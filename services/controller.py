"""Watch, diff, act: what the services' reconcile loops are made of, as Kubernetes' controller-runtime gives every
controller. A loop watches what it follows (a KV bucket's changes, or a view read every pass), works out what
differs from what should be, and acts on that; a watch the server breaks is opened again, loudly, after a pause.

- keep(): run a watch until stopped; one that fails starts again after a pause that grows while it keeps failing.
- watch_kv(): act on each change of a KV bucket's keys (their current values first), and know when those passed.
- SharedRead: several controllers of one source read it once a pass: each diffs that read and acts at its own
  period, in a task of its own, so a slow one holds none of the others up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from services.aio import cancel_and_wait, sleep_unless_stopped

log = logging.getLogger(__name__)
Read = TypeVar("Read")
FIRST_PAUSE_S, MAX_PAUSE_S = 0.5, 30.0
WORKED_S = 60.0  # a watch that failed after running this long starts again after the first pause
POLL_S = 1.0  # how often a KV watch looks at `stop` while nothing changes


async def keep(
    stop: asyncio.Event, what: str, watch: Callable[[asyncio.Event], Awaitable[None]], max_pause_s: float = MAX_PAUSE_S
) -> None:
    """Run watch(stop) until `stop`; one that fails (the server broke its watch: a restart, a limit) starts again,
    `what` and the error logged, after a pause that doubles while it keeps failing."""
    pause = FIRST_PAUSE_S
    while not stop.is_set():
        began = time.monotonic()
        try:
            await watch(stop)
        except Exception as e:
            if time.monotonic() - began > WORKED_S:  # it had worked for a while: a fresh failure
                pause = FIRST_PAUSE_S
            log.warning("%s failed (%s: %s); trying again in %.1fs", what, type(e).__name__, e, pause)
            await sleep_unless_stopped(stop, pause)
            pause = min(pause * 2, max_pause_s)


async def watch_kv(
    kv,
    keys: str,
    stop: asyncio.Event,
    act: Callable[[Any], Awaitable[None]],
    current: Callable[[], Awaitable[None]] | None = None,
    ignore_deletes: bool = True,
) -> None:
    """act(entry) on each change of `keys` in the bucket until `stop`, the keys' current values first, and
    current() once those have passed; a deleted key's entry (ignore_deletes=False) has no value. An error ends it,
    for keep() to watch again."""
    watcher = await kv.watch(keys, ignore_deletes=ignore_deletes)
    try:
        while not stop.is_set():
            try:
                entry = await watcher.updates(timeout=POLL_S)
            except (asyncio.TimeoutError, TimeoutError):
                continue
            if entry is None:  # the end of the current values
                if current is not None:
                    await current()
                continue
            await act(entry)
    finally:
        await watcher.stop()


@dataclass
class Controller(Generic[Read]):
    """One reconcile loop over a shared read: diff(read) -> what differs from what should be, act(each) -> set
    right, every period_s (or later, once its acts of the pass before ended)."""

    name: str
    period_s: float
    diff: Callable[[Read], Iterable[Any]]
    act: Callable[[Any], Awaitable[None]]


class SharedRead(Generic[Read]):
    """Controllers of one source: a pass reads it once, when any of them is due, and each due controller diffs that
    read and acts on what differs in a task of its own. A read that fails is logged and tried at the next pass; an
    act that fails is logged and the controller goes on with the rest (the next pass sees what is left)."""

    def __init__(self, what: str, read: Callable[[], Awaitable[Read]], *controllers: Controller[Read]) -> None:
        self.what, self.read, self.controllers = what, read, controllers
        self.tick_s = min(c.period_s for c in controllers)
        self.reads = 0  # passes that read the source, for the tests
        self._began: dict[str, float] = {}
        self._acting: dict[str, asyncio.Task] = {}

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not await sleep_unless_stopped(stop, self.tick_s):
                due = [c for c in self.controllers if self._due(c)]
                if not due:
                    continue
                try:
                    read = await self.read()
                except Exception as e:
                    log.warning("%s could not be read (%s: %s); looking again", self.what, type(e).__name__, e)
                    continue
                self.reads += 1
                for c in due:
                    self._began[c.name] = time.monotonic()
                    self._acting[c.name] = asyncio.create_task(self._pass(c, read), name=c.name)
        finally:
            await cancel_and_wait(self._acting.values())

    def _due(self, c: Controller[Read]) -> bool:
        acting = self._acting.get(c.name)
        began = self._began.get(c.name)
        return (acting is None or acting.done()) and (began is None or time.monotonic() - began >= c.period_s)

    async def _pass(self, c: Controller[Read], read: Read) -> None:
        try:
            work = list(c.diff(read))
        except Exception as e:
            log.exception("%s: could not compare %s (%s: %s)", c.name, self.what, type(e).__name__, e)
            return
        for each in work:
            try:
                await c.act(each)
            except Exception as e:  # the next pass sees what is still to do
                log.warning("%s: acting failed (%s: %s); the next pass looks again", c.name, type(e).__name__, e)
