"""Running one service command until a signal: the embedded nats-server when no URL is given, the connection, and
an exit code with the reason when it cannot start or stops on an error."""

from __future__ import annotations

import asyncio
import logging
import sys

from services.cli.client import EXIT_FAILED, EXIT_OK
from services.connection import BusOptions
from services.runtime import StartupError, embedded_if_needed, serve

log = logging.getLogger(__name__)


def run_service(args, body, owns_resources: bool = True) -> int:
    """Start the embedded nats-server when no URL is given, run body(nc, stop, args) until a signal; a service
    that cannot start says why and exits 1, and everything it started is stopped."""
    opts = BusOptions.from_args(args, name=f"jetlora-{args.command}")
    server = embedded_if_needed(opts)
    if server:
        print(f"NATS at {server.url} (websocket {server.ws_url}); other commands: --nats {server.url}", flush=True)
        if hasattr(args, "ws_url") and not args.ws_url:
            args.ws_url = server.ws_url
    try:
        asyncio.run(
            serve(
                opts,
                lambda nc, stop: body(nc, stop, args),
                owns_resources or server is not None,
                shutdown_timeout=getattr(args, "shutdown_timeout", 15.0),
            )
        )
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as error:
        for e in _leaves(error):
            if not isinstance(e, StartupError):
                log.error("jetlora %s stopped on an error", args.command, exc_info=e)
            print(
                f"error: {e}"
                if isinstance(e, StartupError)
                else f"error: jetlora {args.command} stopped: {type(e).__name__}: {e}",
                file=sys.stderr,
            )
        return EXIT_FAILED
    finally:
        if server:
            server.stop()


def _leaves(error: BaseException) -> list[BaseException]:
    """The errors inside (nested) exception groups, or the error itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]
