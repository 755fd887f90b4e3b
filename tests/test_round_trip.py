"""A service's connection keeps hearing the server after a round trip that timed out (services/connection.py).

Found by bench/chaos.py: an agent blackholed 3 s had its heartbeat's nc.flush(timeout=2) time out; nats-py then
cancelled the PONG's future but left it queued, the late PONG raised InvalidStateError in the read loop, and the
loop ended. The agent went on sending heartbeats and heard nothing: the scheduler placed jobs on it every 2 s for
minutes, none ever answered."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest

from services.connection import BusOptions, connect, round_trip
from tests.conftest import wait_for
from tests.harness.proxy import NatsProxy


async def _hears(listener, speaker, subject: str, what: str, within: float = 30) -> None:
    """The listener gets what the speaker publishes (sent again until it does: the first may be lost to a reconnect)."""
    heard = asyncio.Event()

    async def got(_msg) -> None:
        heard.set()

    sub = await listener.subscribe(subject, cb=got)
    try:

        async def arrived() -> bool:
            await speaker.publish(subject, b"x")
            await speaker.flush()
            try:
                await asyncio.wait_for(heard.wait(), 0.5)
            except asyncio.TimeoutError:
                return False
            return True

        await wait_for(arrived, timeout=within, what=what)
    finally:
        await sub.unsubscribe()


async def test_a_round_trip_that_timed_out_leaves_the_connection_hearing(nats_server):
    proxy = NatsProxy(nats_server.url).start()
    direct = await nats.connect(nats_server.url)
    nc = await connect(BusOptions(url=proxy.url, name="cut-off"))
    try:
        await _hears(nc, direct, "rt.before", "the proxied connection to hear before the partition")
        proxy.blackhole(seconds=3)  # the PING is held; its PONG comes after the caller gave up
        with pytest.raises(nats.errors.FlushTimeoutError):
            await round_trip(nc, 1.0)
        await wait_for(lambda: not proxy.blackholed, timeout=10, what="the partition to heal")
        await round_trip(nc, 10.0)  # the late PONG went to the first round trip's live future, this one gets its own
        # at once, not after the stale-connection window (PING_INTERVAL_S x MAX_OUTSTANDING_PINGS) replaced it
        await _hears(nc, direct, "rt.after", "the connection to hear after a round trip timed out", within=8)
    finally:
        await nc.close()
        await direct.close()
        proxy.close()
