"""Running a service: one event loop, SIGTERM/SIGINT set a stop event, the connection is drained on the way out."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from services.aio import cancel_and_wait
from services.bus import ensure_resources
from services.connection import BusOptions, connect
from services.embedded import EmbeddedNats, state_dir

log = logging.getLogger("jetlora")


class StartupError(Exception):
    """A service cannot start (a port taken, a flag missing): the message says what to do."""


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )


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
    log.info(
        "started an embedded nats-server at %s (websocket %s, data in %s)", server.url, server.ws_url, server.store_dir
    )
    return server


class ShutdownTimeout(Exception):
    """A signal asked the service to stop, and it had not finished within its shutdown timeout."""


async def serve(
    opts: BusOptions, body: Callable[..., Awaitable[None]], owns_resources: bool = True, shutdown_timeout: float = 15.0
) -> None:
    """Connect, make sure the JetStream resources exist (services that own them), run body(nc, stop) until a
    signal, then drain. Agents and the dashboard own none: their credentials may not create streams.

    After the signal the body has `shutdown_timeout` seconds to finish its work (hand jobs back, publish last
    states), and the drain a few more; what is left then is ended, and ShutdownTimeout says what it was."""
    stop = asyncio.Event()
    stop_on_signals(stop)
    nc = await connect(opts)
    try:
        if owns_resources:
            await ensure_resources(nc, opts.replicas)
        await _until_done_or_late(body(nc, stop), stop, shutdown_timeout)
    finally:
        await _drain(nc)


async def _until_done_or_late(work: Awaitable[None], stop: asyncio.Event, timeout: float) -> None:
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            log.info("stopping: %.0fs to finish what runs", timeout)
            done, _ = await asyncio.wait([task], timeout=timeout)
            if not done:
                left = _what_runs()
                await cancel_and_wait([task])
                raise ShutdownTimeout(
                    f"did not finish within {timeout:.0f}s of the signal and was ended: {left} "
                    "(raise --shutdown-timeout, or look at the log above for what it waited on)"
                )
        await task  # its own error, if it ended with one
    finally:
        await cancel_and_wait([stopping])


def _what_runs() -> str:
    current = asyncio.current_task()
    names = sorted({t.get_name() for t in asyncio.all_tasks() if t is not current and not t.done()})
    return ", ".join(names[:12]) or "nothing named"


async def _drain(nc, timeout: float = 5.0) -> None:
    """Drain the connection, or close it when the server is gone (a drain would wait for it in vain)."""
    if nc.is_closed:
        return
    try:
        if nc.is_connected:
            await asyncio.wait_for(nc.drain(), timeout)
            return
    except Exception as e:
        log.warning("the NATS connection did not drain (%s); closing it", type(e).__name__)
    try:
        await nc.close()
    except Exception as e:  # the server went away under it: there is nothing left to flush
        log.warning("closing the NATS connection: %s: %s", type(e).__name__, e)
