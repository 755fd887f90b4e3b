"""A TCP proxy in front of nats-server that injects network faults: partitions, resets, and JetStream writes that
are lost or land late. It runs its own asyncio loop in a daemon thread, so it serves subprocesses and is not slowed
by the test's loop; every public method may be called from any thread or loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import struct
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from services.embedded import free_port
from tests.harness.protocol import Splitter, strip_connect_urls

CHUNK = 1 << 18
STREAM_LIMIT = 1 << 20
JETSTREAM_PREFIXES = ("$JS.", "$KV.", "$O.")


@dataclass(frozen=True)
class WriteHold:
    """Which client publishes are held back, and how: dropped, or forwarded `delay_s` late."""

    prefixes: tuple[bytes, ...]
    mode: Literal["drop", "delay"]
    delay_s: float


def _address(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    return parts.hostname or "127.0.0.1", parts.port or 4222


def _abort(writer: asyncio.StreamWriter, reset: bool = False) -> None:
    """Close a connection at once; with `reset`, the peer sees a TCP reset rather than an orderly close."""
    if reset:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
    writer.transport.abort()


class NatsProxy:
    """Forwards NATS connections from `url` to the first of `upstream` (a URL, comma-separated URLs, or a list)
    that accepts, and injects faults into all of them on demand."""

    def __init__(self, upstream: str | Sequence[str], port: int | None = None):
        urls = upstream.split(",") if isinstance(upstream, str) else list(upstream)
        self.upstreams = [_address(u.strip()) for u in urls if u.strip()]
        self.port = port or free_port()
        self._counts = {"accepted": 0, "cut": 0, "dropped": 0, "delayed": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._links: set[_Link] = set()
        self._gate: asyncio.Event | None = None  # set: bytes flow; clear: a partition
        self._hold: WriteHold | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def stats(self) -> dict[str, int]:
        """Connections accepted and cut, client frames dropped and delayed, and connections open now."""
        return {**self._counts, "open": len(self._links)}

    @property
    def blackholed(self) -> bool:
        return self._gate is not None and not self._gate.is_set()

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> "NatsProxy":
        """Listen on 127.0.0.1:`port` from a new daemon thread; returns once it listens."""
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"nats-proxy-{self.port}", daemon=True)
        self._thread.start()
        ready.result(timeout=10)
        return self

    def close(self) -> None:
        """Stop listening, end every connection, stop the thread."""
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            return
        self._call(self._shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(10)

    def __enter__(self) -> "NatsProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._gate = asyncio.Event()
            self._gate.set()
            self._server = loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", self.port, limit=STREAM_LIMIT)
            )
        except BaseException as e:
            loop.close()
            ready.set_exception(e)
            return
        ready.set_result(None)
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for timer in self._timers.values():
            timer.cancel()
        self._gate.set()
        for link in list(self._links):
            link.abort(reset=False)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the proxy's loop, waited for (so a fault is in force when the method returns)."""
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the proxy is not running")
        if threading.current_thread() is self._thread:
            return fn(*args)
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as e:
                done.set_exception(e)

        self._loop.call_soon_threadsafe(run)
        return done.result(timeout=10)

    def _after(self, key: str, seconds: float | None, fn: Callable[[], None]) -> None:
        """Replace the timer `key` with fn after `seconds` (None: no timer)."""
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        if seconds is not None:
            self._timers[key] = self._loop.call_later(seconds, fn)

    # --- faults ----------------------------------------------------------------------------------------------
    def blackhole(self, seconds: float | None = None) -> None:
        """A partition: no byte flows either way on any connection, current or new, and none is closed; what
        arrives meanwhile is delivered, in order, after heal() (by itself after `seconds`, if given)."""

        def apply() -> None:
            self._gate.clear()
            self._after("heal", seconds, self._heal)

        self._call(apply)

    def heal(self) -> None:
        """End a blackhole: held bytes flow again."""
        self._call(self._heal)

    def _heal(self) -> None:
        self._after("heal", None, lambda: None)
        self._gate.set()

    def cut(self) -> int:
        """Reset every current connection (the clients reconnect, through the proxy); returns how many."""

        def apply() -> int:
            links = list(self._links)
            for link in links:
                link.abort(reset=True)
            self._counts["cut"] += len(links)
            return len(links)

        return self._call(apply)

    def hold_writes(
        self,
        prefixes: tuple[str, ...] = JETSTREAM_PREFIXES,
        mode: Literal["drop", "delay"] = "drop",
        seconds: float | None = None,
        delay_s: float = 0.0,
    ) -> None:
        """Hold back client PUB/HPUB frames whose subject starts with one of `prefixes`: drop them (the client's
        JetStream request times out, as during a leader election, while core requests are answered), or forward
        them `delay_s` late, in their own order; every other frame flows. Until `seconds` pass (None: until
        release_writes())."""
        if mode not in ("drop", "delay"):
            raise ValueError(f"mode must be 'drop' or 'delay', not {mode!r}")
        hold = WriteHold(tuple(p.encode() for p in prefixes), mode, delay_s)

        def apply() -> None:
            self._hold = hold
            self._after("release", seconds, self._release)

        self._call(apply)

    def release_writes(self) -> None:
        """Stop holding writes back (frames already delayed still land at their time)."""
        self._call(self._release)

    def _release(self) -> None:
        self._after("release", None, lambda: None)
        self._hold = None

    # --- connections -----------------------------------------------------------------------------------------
    def _classify(self, op: bytes, subject: bytes) -> WriteHold | None:
        hold = self._hold
        if hold is not None and op in (b"PUB", b"HPUB") and subject.startswith(hold.prefixes):
            return hold
        return None

    def _count(self, key: str) -> None:
        self._counts[key] += 1

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self._counts["accepted"] += 1
        upstream = await self._open_upstream()
        if upstream is None:
            _abort(cwriter, reset=True)
            return
        link = _Link(self, creader, cwriter, *upstream)
        self._links.add(link)
        try:
            await link.run()
        finally:
            self._links.discard(link)

    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for host, port in self.upstreams:
            try:
                return await asyncio.wait_for(asyncio.open_connection(host, port, limit=STREAM_LIMIT), 2)
            except (OSError, asyncio.TimeoutError):
                continue
        return None

    async def _open_gate(self) -> None:
        if not self._gate.is_set():
            await self._gate.wait()


class _Link:
    """One client connection and the proxy's own connection to the server: a pump each way, and the queue of
    client frames to forward late."""

    def __init__(
        self,
        proxy: NatsProxy,
        creader: asyncio.StreamReader,
        cwriter: asyncio.StreamWriter,
        ureader: asyncio.StreamReader,
        uwriter: asyncio.StreamWriter,
    ):
        self.proxy = proxy
        self.creader, self.cwriter, self.ureader, self.uwriter = creader, cwriter, ureader, uwriter
        self.up = Splitter(classify=proxy._classify)
        self.down = Splitter(rewrite=strip_connect_urls)
        self.late: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self.boundary = asyncio.Event()  # set while the bytes sent upstream end between two frames
        self.boundary.set()

    async def run(self) -> None:
        pumps = [asyncio.create_task(self._pump_up()), asyncio.create_task(self._pump_down())]
        late = asyncio.create_task(self._forward_late())
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*pumps, late):
                task.cancel()
            await asyncio.gather(*pumps, late, return_exceptions=True)
            for writer in (self.cwriter, self.uwriter):
                writer.close()

    def abort(self, reset: bool) -> None:
        _abort(self.cwriter, reset)
        _abort(self.uwriter)

    async def _pump_up(self) -> None:
        """Client to server: frames the proxy holds go to the late queue or nowhere; the rest flow in order."""
        loop = asyncio.get_running_loop()
        while data := await self.creader.read(CHUNK):
            await self.proxy._open_gate()
            passed, held = self.up.feed(data)
            if passed:
                self.uwriter.write(passed)
            if self.up.at_boundary:
                self.boundary.set()
            else:
                self.boundary.clear()
            for hold, frame in held:
                if hold.mode == "drop":
                    self.proxy._count("dropped")
                else:
                    self.proxy._count("delayed")
                    self.late.put_nowait((loop.time() + hold.delay_s, frame))
            await self.uwriter.drain()

    async def _pump_down(self) -> None:
        """Server to client, with the servers' own addresses taken out of INFO."""
        while data := await self.ureader.read(CHUNK):
            await self.proxy._open_gate()
            passed, _ = self.down.feed(data)
            if passed:
                self.cwriter.write(passed)
            await self.cwriter.drain()

    async def _forward_late(self) -> None:
        """Delayed frames, each at its time and in the order they came, put in between two upstream frames."""
        loop = asyncio.get_running_loop()
        while True:
            due, frame = await self.late.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)  # the fault itself: a write that lands late
            while not (self.proxy._gate.is_set() and self.boundary.is_set()):
                await self.proxy._open_gate()
                await self.boundary.wait()
            self.uwriter.write(frame)
            await self.uwriter.drain()
