"""HTTP to the node's serving engines, on the agent's own event loop (aiohttp): no engine call waits in a thread,
so an engine that hangs holds up only the call that asked it, never the heartbeats. Each owner that lives as long
as the agent (the deployment, each engine's load watch) keeps one session, made on its first call inside the running
loop and closed when the owner stops; every call has its own timeout."""

from __future__ import annotations

import asyncio
import errno
import json

import aiohttp

BODY_LIMIT = 16 * 2**20  # the most of an answer that is read (a /metrics page is ~50 KB, a model list far less)


class NoAnswer(OSError):
    """Nothing answered: the connection was refused or broke, or no whole answer came within the timeout.
    `reason` says which in a few words; the message also names the request."""

    def __init__(self, method: str, url: str, reason: str) -> None:
        super().__init__(f"{method} {url}: {reason}")
        self.url, self.reason = url, reason


class BadStatus(OSError):
    """The engine answered, with an HTTP error status (what urllib's HTTPError meant)."""

    def __init__(self, url: str, status: int, text: str) -> None:
        super().__init__(f"GET {url}: HTTP {status}: {text[:200]}")
        self.url, self.status, self.reason = url, status, f"HTTP {status}"


class EngineHttp:
    """One owner's aiohttp session: `request()` asks an engine, `close()` (at the owner's end) lets it go."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _open(self) -> aiohttp.ClientSession:
        """The session, made on first use inside the running loop (and again on another loop: an owner used by
        more than one asyncio.run, as a test may)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # no compressed answers (urllib asked for none): compressing /metrics, up to 20 times a second, would
            # cost the engine the CPU the /load page was chosen to spare it
            self._session, self._loop = aiohttp.ClientSession(headers={"Accept-Encoding": "identity"}), loop
        return self._session

    async def request(
        self, method: str, url: str, timeout: float, body: object = None, limit: int = BODY_LIMIT
    ) -> tuple[int, bytes]:
        """(status, body) of the engine's answer, an error status included; `body` goes as JSON. Raises NoAnswer
        where none came within `timeout` seconds (connecting, sending and reading it whole)."""
        session = self._open()
        data = None if body is None else json.dumps(body).encode()
        headers = None if body is None else {"Content-Type": "application/json"}
        try:
            async with session.request(
                method, url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                return r.status, await _read(r, limit)
        except TimeoutError:
            raise NoAnswer(method, url, f"no answer within {timeout:g}s") from None
        except aiohttp.ClientConnectorError as e:
            raise NoAnswer(method, url, _refused(e.os_error)) from None
        except aiohttp.ServerDisconnectedError:
            raise NoAnswer(method, url, "it closed the connection without answering") from None
        except (aiohttp.ClientError, OSError) as e:
            raise NoAnswer(method, url, f"{type(e).__name__}: {e}") from None

    async def close(self) -> None:
        """Close the session (its pooled connections); a later call opens a new one."""
        session, self._session = self._session, None
        if session is not None and not session.closed and self._loop is asyncio.get_running_loop():
            await session.close()


async def _read(r: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most `limit` bytes of the answer's body (StreamReader.read(n) may return fewer than n at a time)."""
    chunks, size = [], 0
    while size < limit:
        chunk = await r.content.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _refused(error: OSError) -> str:
    """A failed connect in a few words: "connection refused" where nothing listens, else what the OS said."""
    if isinstance(error, ConnectionRefusedError) or error.errno == errno.ECONNREFUSED:
        return "connection refused"
    return f"cannot connect: {error.strerror or error}"
