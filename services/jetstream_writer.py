"""JetStream publishes that wait for the stream's ack at a third less CPU than nats-py's js.publish: one reply
subscription per connection with acks matched by a counter, and their time limits swept a few times a second by
one task, instead of a token, a response-map entry and a timer per message (js.publish: about 43 us of client CPU
per write here; this: about 27 us). The scheduler's every status write goes through it, and the artifact
service's object chunks (send: several in flight, each with a time limit, where nats-py's publish_async waits
forever for an ack that was lost)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Any

import msgspec

import nats.errors
from nats.js import api
from nats.js.errors import APIError

SWEEP_S = 0.05  # how often unanswered publishes are checked against their time limit
EXPECTED_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"  # a write lands only if its subject's last is this
EXPECTED_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"  # ... or this other subject's (a fence)
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when an expected sequence does not hold


class _Ack(msgspec.Struct):
    """A stream's answer to a publish: where it stored it, or why it did not."""

    stream: str = ""
    seq: int = 0
    domain: str | None = None
    duplicate: bool | None = None
    error: dict[str, Any] | None = None


_ack = msgspec.json.Decoder(_Ack)


class JetStreamWriter:
    """Publishes on one connection; `publish` returns the stream's ack, or raises as js.publish does
    (nats.errors.TimeoutError, NoRespondersError, or the stream's APIError)."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self._prefix = ""
        self._sub = None
        self._count = itertools.count()
        self._waiting: dict[str, asyncio.Future] = {}
        self._deadlines: collections.deque[tuple[float, str]] = collections.deque()  # in order: one time limit each
        self._sweeper: asyncio.Task | None = None
        self._starting: asyncio.Lock | None = None

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None, timeout: float = 2.0
    ) -> api.PubAck:
        return self.ack(await (await self.send(subject, payload, headers, timeout)))

    async def send(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None, timeout: float = 2.0
    ) -> asyncio.Future:
        """Publish now (in the order of the calls) and return a future of the stream's answer, which fails with
        nats.errors.TimeoutError past `timeout`: for writers that keep several in flight (object chunks).
        `ack(answer)` reads it. Unlike nats-py's publish_async, an answer that never comes does not hang."""
        if self._sub is None:
            await self._subscribe()
        token = str(next(self._count))
        answer = asyncio.get_running_loop().create_future()
        self._waiting[token] = answer
        self._deadlines.append((time.monotonic() + timeout, token))
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep())
        try:
            await self.nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
        except BaseException:
            self._waiting.pop(token, None)
            raise
        return answer

    @staticmethod
    def ack(msg) -> api.PubAck:
        """The stream's answer as a PubAck; raises as js.publish does when it is a refusal. Read by msgspec: the
        json module and PubAck.from_response's walk over its dataclass fields cost a scheduler ~7% of its CPU in a
        burst of submissions (bench/control_plane.py), every status write being one publish."""
        if msg.headers and msg.headers.get("Status") == "503":
            raise nats.errors.NoRespondersError
        reply = _ack.decode(msg.data)
        if reply.error is not None:
            raise APIError.from_error(reply.error)
        return api.PubAck(stream=reply.stream, seq=reply.seq, domain=reply.domain, duplicate=reply.duplicate)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection is gone with it
                pass
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(nats.errors.ConnectionClosedError())

    async def _subscribe(self) -> None:
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._sub is None:
                prefix = self.nc.new_inbox() + "."
                self._sub = await self.nc.subscribe(prefix + "*", cb=self._on_ack)
                self._prefix = prefix

    async def _on_ack(self, msg) -> None:
        answer = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if answer is not None and not answer.done():
            answer.set_result(msg)

    async def _sweep(self) -> None:
        """Fail what waited past its limit; ends when nothing waits."""
        while self._deadlines:
            now = time.monotonic()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, token = self._deadlines.popleft()
                answer = self._waiting.pop(token, None)
                if answer is not None and not answer.done():
                    answer.set_exception(nats.errors.TimeoutError())
            while self._deadlines and self._deadlines[0][1] not in self._waiting:
                self._deadlines.popleft()  # answered already
            await asyncio.sleep(SWEEP_S)


class ViaJsPublish:
    """The same call through nats-py's own js.publish: for a store used outside a service (tools, tests)."""

    def __init__(self, js) -> None:
        self.js = js

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None, timeout: float = 2.0
    ) -> api.PubAck:
        return await self.js.publish(subject, payload, timeout=timeout, headers=headers)
