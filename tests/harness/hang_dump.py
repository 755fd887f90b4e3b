"""What a hung test waits on: pytest-timeout prints every thread's stack, and a test hung in an await shows only its
event loop's `select`. This adds each asyncio task of the running loop, the chain of what it awaits down to the
future it is parked on, so a hang in a fixture's teardown names the coroutine and line it waits in."""

from __future__ import annotations

import asyncio


def awaited_chain(task: asyncio.Task) -> list[str]:
    """The task's coroutine and each coroutine it awaits, innermost last, then what that one is parked on."""
    lines, coro = [], task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        inner = (
            getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
        )
        if inner is not None and not hasattr(inner, "cr_frame") and not hasattr(inner, "gi_frame"):
            lines.append(f"  parked on {inner!r}"[:300])
            break
        coro = inner
    return lines


def install() -> None:
    """Wrap pytest-timeout's stack dump (it runs in the timed-out test's main thread, inside the loop's select)."""
    import pytest_timeout

    threads_only = pytest_timeout.dump_stacks

    def dump_stacks(terminal) -> None:
        threads_only(terminal)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for task in asyncio.all_tasks(loop):
            terminal.sep("~", title=f"asyncio task {task.get_name()}")
            terminal.write("\n".join(awaited_chain(task)) + "\n")

    pytest_timeout.dump_stacks = dump_stacks


async def bounded(awaitable, seconds: float, what: str):
    """A fixture's teardown step that must end: past `seconds`, the test fails naming `what` and every task's awaited
    chain (rather than holding its worker until pytest-timeout, minutes later)."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        chains = "\n".join(
            f"task {t.get_name()}:\n" + "\n".join(awaited_chain(t)) for t in asyncio.all_tasks() if not t.done()
        )
        raise AssertionError(
            f"{what} did not end within {seconds:g} s; what the loop's tasks await:\n{chains}"
        ) from None
