"""Grading is async (sandboxes are asyncio subprocesses, the judge an aiohttp client), so that cancelling a call
kills what it started; run() serves the synchronous callers (the trainer's rollouts, code already in a thread)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """The coroutine's result, run to its end on a loop of its own: in this thread where none runs here, else in a
    thread of its own (blocking the caller, as the synchronous call it replaces did)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="jetlora-grading") as pool:
        return pool.submit(asyncio.run, coro).result()
