"""Running a service: one event loop, SIGTERM/SIGINT set a stop event, the connection is drained on the way out."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from services.bus import BusOptions, connect, ensure_resources
from services.embedded import EmbeddedNats, state_dir

log = logging.getLogger("jetlora")


class StartupError(Exception):
    """A service cannot start (a port taken, a flag missing): the message says what to do."""


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def embedded_if_needed(opts: BusOptions) -> EmbeddedNats | None:
    """No URL given: start our own nats-server with storage in the user's state dir."""
    if opts.url:
        return None
    server = EmbeddedNats(store_dir=state_dir() / "nats").start()
    opts.url = server.url
    log.info("started an embedded nats-server at %s (websocket %s, data in %s)", server.url, server.ws_url, server.store_dir)
    return server


async def serve(opts: BusOptions, body: Callable[..., Awaitable[None]], owns_resources: bool = True) -> None:
    """Connect, make sure the JetStream resources exist (services that own them), run body(nc, stop) until a
    signal, then drain. Agents and the dashboard own none: their credentials may not create streams."""
    stop = asyncio.Event()
    stop_on_signals(stop)
    nc = await connect(opts)
    try:
        if owns_resources:
            await ensure_resources(nc, opts.replicas)
        await body(nc, stop)
    finally:
        if not nc.is_closed:
            await nc.drain()
