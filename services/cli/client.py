"""How every client command talks to NATS: connect, ask, and turn what comes back into an exit code."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from nats.aio.client import Client

from schemas.jobs import Error
from services import bus, connection
from services.connection import BusOptions

T = TypeVar("T")
EXIT_OK, EXIT_FAILED, EXIT_REJECTED, EXIT_UNREACHABLE = 0, 1, 2, 3


class CommandFailed(Exception):
    """The service answered with an error: printed once, exit code 1 (or the code given)."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


async def ask(nc: Client, subject: str, message, reply_type: type[T], timeout: float = bus.DEFAULT_TIMEOUT) -> T:
    """A request whose `Error` reply ends the command (CommandFailed); any other reply is returned."""
    reply = await bus.request(nc, subject, message, reply_type | Error, timeout=timeout)  # type: ignore[operator]
    if isinstance(reply, Error):
        raise CommandFailed(reply.error)
    return reply


def run_client(args, body: Callable[[Client], Awaitable[int]]) -> int:
    """Connect (failing fast), run body(nc), drain; every failure becomes a message on stderr and an exit code."""
    opts = BusOptions.from_args(args, name="jetlora-cli")
    if not opts.url:
        print("give --nats URL (or NATS_URL) of the server that `jetlora up` printed", file=sys.stderr)
        return EXIT_UNREACHABLE

    async def go():
        try:
            nc = await connection.connect(opts, service=False)
        except Exception as e:  # nats-py raises NoServersError, OSError or TimeoutError here
            raise OSError(f"{type(e).__name__} {e}".strip()) from None
        try:
            return await body(nc)
        finally:
            await nc.drain()

    try:
        return asyncio.run(go())
    except CommandFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except bus.RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except OSError as e:
        print(f"error: cannot reach NATS at {connection.redacted(opts.url)}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE


def show(obj, as_json: bool, table: Callable[[object], None]) -> None:
    if as_json:
        sys.stdout.write(msgspec.json.encode(obj).decode() + "\n")
    else:
        table(obj)
