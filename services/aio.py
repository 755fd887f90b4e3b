"""Small asyncio helpers every service shares: a sleep that a stop cuts short, tasks ended and awaited, tasks run
together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable

log = logging.getLogger(__name__)


async def sleep_unless_stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` or until `stop` is set; True when stopped."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return stop.is_set()


async def cancel_and_wait(tasks: Iterable[asyncio.Task | asyncio.Future | None]) -> None:
    """Cancel the tasks and wait until each has ended; an error one of them ends with is logged, not raised."""
    pending = [t for t in tasks if t is not None]
    for t in pending:
        t.cancel()
    for t, result in zip(pending, await asyncio.gather(*pending, return_exceptions=True)):
        if isinstance(result, Exception):
            log.warning("a task ended with %s: %s", type(result).__name__, result)


async def wait_first(*events: asyncio.Event) -> None:
    """Return once any of the events is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(waits)


async def together(*work: Awaitable[None]) -> None:
    """Run them at once until each has ended; the first that fails ends the others (awaited), and its error is
    raised as it is."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = [e for t in done if not t.cancelled() and (e := t.exception()) is not None]
        if errors:
            raise errors[0]
    finally:
        await cancel_and_wait([t for t in tasks if not t.done()])
