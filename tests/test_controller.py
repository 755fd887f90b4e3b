"""The reconcile loops' plumbing (services/controller.py): a KV watch acts on the current values, says when they have
passed and acts on each change after; a watch that fails is started again with a growing pause; controllers of one
source share one read a pass, and a slow one holds none of the others up."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.js.api import KeyValueConfig
from nats.js.errors import NotFoundError, ServerError

from services.controller import Controller, SharedRead, keep, watch_kv
from tests.conftest import retrying, wait_for

BUCKET = "controller_test"


async def test_a_kv_watch_acts_on_current_values_then_on_each_change(nc):
    js = nc.jetstream()
    with contextlib.suppress(NotFoundError):
        await js.delete_key_value(BUCKET)
    kv = await retrying(lambda: js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1)), ServerError)
    await kv.put("a", b"1")
    await kv.put("b", b"2")
    seen: list[tuple[str, bytes | None]] = []
    current = asyncio.Event()

    async def act(entry) -> None:
        seen.append((entry.key, entry.value or None))

    async def passed() -> None:
        seen.append(("(current)", None))
        current.set()

    stop = asyncio.Event()
    watching = asyncio.create_task(keep(stop, "test watch", lambda stop: watch_kv(kv, ">", stop, act, passed, False)))
    try:
        await asyncio.wait_for(current.wait(), 10)
        await kv.put("a", b"3")
        await kv.delete("b")
        await wait_for(lambda: len(seen) >= 5, what="the change and the deletion")
        assert seen == [("a", b"1"), ("b", b"2"), ("(current)", None), ("a", b"3"), ("b", None)], seen
    finally:
        stop.set()
        await asyncio.wait_for(watching, 5)
        await js.delete_key_value(BUCKET)


async def test_a_failing_watch_starts_again_after_a_pause_that_grows(caplog):
    caplog.set_level(logging.WARNING, logger="services.controller")
    stop, calls = asyncio.Event(), []

    async def watch(stop: asyncio.Event) -> None:
        calls.append(asyncio.get_running_loop().time())
        if len(calls) <= 2:
            raise ConnectionError("the server broke the watch")
        await stop.wait()

    keeping = asyncio.create_task(keep(stop, "test: following something", watch))
    await wait_for(lambda: len(calls) == 3, timeout=10, what="the third start")
    stop.set()
    await asyncio.wait_for(keeping, 5)
    assert calls[1] - calls[0] >= 0.45 and calls[2] - calls[1] >= 0.95, calls
    said = [
        r.getMessage() for r in caplog.records if r.name == "services.controller"
    ]  # (a client an earlier test left)
    assert said == [
        "test: following something failed (ConnectionError: the server broke the watch); trying again in 0.5s",
        "test: following something failed (ConnectionError: the server broke the watch); trying again in 1.0s",
    ], said


async def test_controllers_share_one_read_a_pass_and_a_slow_one_holds_none_up(caplog):
    caplog.set_level(logging.WARNING, logger="services.controller")
    reads: list[int] = []
    fast: list[int] = []
    slow: list[tuple[int, int]] = []  # (the pass it acted on, the fast controller's passes when its act ended)
    acting: list[int] = []
    peak = 0

    async def read() -> list[int]:
        reads.append(len(reads) + 1)
        return [len(reads)]

    async def note_fast(n: int) -> None:
        fast.append(n)
        if n == 2:
            raise RuntimeError("one act failed")

    async def note_slow(n: int) -> None:
        nonlocal peak
        acting.append(n)
        peak = max(peak, len(acting))
        await asyncio.sleep(0.6)  # a gate asking a slow evals service
        acting.remove(n)
        slow.append((n, len(fast)))

    shared = SharedRead(
        "the test source",
        read,
        Controller("fast", 0.1, lambda r: r, note_fast),
        Controller("slow", 0.2, lambda r: r, note_slow),
    )
    stop = asyncio.Event()
    running = asyncio.create_task(shared.run(stop))
    await wait_for(lambda: len(slow) >= 2, timeout=10, what="two acts of the slow controller")
    stop.set()
    await asyncio.wait_for(running, 5)
    assert peak == 1, peak  # one act of a controller at a time
    (first, before), (second, _) = slow[:2]
    assert first == 1 and before >= 3, slow  # the fast one went on while the slow one's first act took its time
    assert second > first + 2, slow  # the slow one took a later read once its act ended, not one per period
    assert shared.reads == len(reads) <= len(fast) + 1, (reads, fast)  # the slow one's passes read nothing more
    assert fast == reads[: len(fast)], (
        fast,
        reads,
    )  # every pass's read reached the fast one: a failed act ends nothing
    assert any("fast: acting failed (RuntimeError: one act failed)" in r.getMessage() for r in caplog.records)
