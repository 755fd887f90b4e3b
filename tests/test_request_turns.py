"""One tenant's slow requests never hold up another's: a request waits for its own tenant's turn before it takes
one of the slots every tenant shares (services/bus.py Concurrently), on a real micro service."""

from __future__ import annotations

import asyncio
import time

import nats.micro
import pytest

from schemas.jobs import Error
from schemas.job_status import JobQuery
from services import bus

SLOW_S = 1.0


@pytest.mark.timeout(60)
async def test_a_tenant_flooding_slow_requests_leaves_another_tenants_answered_at_once(nc):
    tasks: set[asyncio.Task] = set()

    def spawn(coro) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def serve(q: JobQuery, subject: str) -> Error:
        if subject.startswith("turns.flood."):
            await asyncio.sleep(SLOW_S)  # a cancel to a node that does not answer, a long page of events
        return Error(f"answered {q.job}")

    turns = bus.Concurrently(spawn, 8, per_key=2, queued_per_key=64, key=lambda s: s.split(".")[1])
    service = await nats.micro.add_service(nc, name="turns", version="0.0.1")
    group = service.add_group(name="turns")
    await bus.add_endpoint(group, "ask", bus.handler(serve, JobQuery, with_subject=True), "*.ask", concurrently=turns)
    try:
        flood = [
            asyncio.create_task(bus.request(nc, "turns.flood.ask", JobQuery(f"f{i}"), Error, timeout=60))
            for i in range(40)
        ]
        await asyncio.sleep(0.2)  # the flood is in: its requests wait for the flooding tenant's two turns
        waits = []
        for i in range(20):
            t0 = time.monotonic()
            reply = await bus.request(nc, "turns.quiet.ask", JobQuery(f"q{i}"), Error, timeout=10)
            waits.append(time.monotonic() - t0)
            assert reply.error == f"answered q{i}"
        waits.sort()
        assert waits[-1] < SLOW_S / 2, (
            f"the quiet tenant waited {waits[-1]:.2f}s behind the flood (p50 {waits[10]:.3f}s)"
        )
        print(
            f"quiet tenant p50 {waits[10] * 1000:.1f} ms, max {waits[-1] * 1000:.1f} ms beside a flood of 40 slow requests"
        )
        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    finally:
        await service.stop()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
