"""Small asyncio helpers every service shares: a sleep that a stop cuts short, tasks ended and awaited."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

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
