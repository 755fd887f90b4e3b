"""The newest message of every subject in a slice of a stream, held in memory by one long-lived consumer: how a
service answers `list` and `show` requests without creating a consumer per request.

A read first asks the stream (one message lookup, no consumer) for the newest sequence in the slice and waits
until the view has seen it, so a reply is never older than the request: a change another instance made before
the request is in it. A view that cannot catch up within its deadline rebuilds itself and the read fails loudly."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from nats.js.api import DeliverPolicy, ObjectInfo
from nats.js.errors import NotFoundError

from schemas import names
from services.aio import sleep_unless_stopped

log = logging.getLogger(__name__)
KV_OPERATION = "KV-Operation"


class StaleView(Exception):
    """The view could not catch up with its stream in time: the read has no trustworthy answer."""


class LatestView:
    """`entries` maps each subject's key to its decoded newest value; removed subjects are absent."""

    def __init__(
        self,
        js,
        stream: str,
        subjects: str,
        decode: Callable[[str, Any], Any | None],
        key: Callable[[str], str] = lambda subject: subject,
        catch_up_s: float = 5.0,
    ) -> None:
        """decode(key, msg) -> the value to keep, or None when the message removes the key."""
        self.js, self.stream, self.subjects = js, stream, subjects
        self.decode, self.key, self.catch_up_s = decode, key, catch_up_s
        self.entries: dict[str, Any] = {}
        self.seen = 0  # the newest stream sequence applied
        self._tick = asyncio.Event()
        self._rebuild = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the stream until `stop`; a broken consumer is rebuilt from the stream, with a growing pause."""
        pause = 0.5
        while not stop.is_set():
            try:
                await self._follow(stop)
                pause = 0.5
            except Exception as e:
                log.warning(
                    "the view of %s %s broke (%s: %s); rebuilding it in %.1fs",
                    self.stream,
                    self.subjects,
                    type(e).__name__,
                    e,
                    pause,
                )
                await sleep_unless_stopped(stop, pause)
                pause = min(pause * 2, 10.0)

    async def _follow(self, stop: asyncio.Event) -> None:
        self._rebuild.clear()
        self.entries, self.seen = {}, 0  # readers that wait see only a complete view again
        sub = await self.js.subscribe(
            self.subjects,
            stream=self.stream,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            idle_heartbeat=2.0,
        )
        try:
            while not stop.is_set() and not self._rebuild.is_set():
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except TimeoutError:
                    continue
                self._apply(msg)
        finally:
            await asyncio.shield(sub.unsubscribe())

    def _apply(self, msg) -> None:
        key = self.key(msg.subject)
        try:
            value = self.decode(key, msg)
        except Exception as e:  # one foreign message must not stop the view
            log.warning("the view of %s skipped %s: it did not decode (%s)", self.stream, msg.subject, e)
            value = None
        if value is None:
            self.entries.pop(key, None)
        else:
            self.entries[key] = value
        self.seen = max(self.seen, msg.metadata.sequence.stream)
        self._tick.set()
        self._tick = asyncio.Event()

    async def snapshot(self) -> dict[str, Any]:
        """The entries as of now (at least): wait for the newest message the stream holds in this slice."""
        try:
            target = (await self.js.get_msg(self.stream, subject=self.subjects)).seq or 0
        except NotFoundError:
            target = 0
        try:
            async with asyncio.timeout(self.catch_up_s):
                while self.seen < target:
                    await self._tick.wait()
        except TimeoutError:
            self._rebuild.set()
            raise StaleView(
                f"the view of {self.stream} is at sequence {self.seen}, not {target}, after "
                f"{self.catch_up_s:.0f}s; it is being rebuilt, try again"
            ) from None
        return self.entries


def kv_view(js, bucket: str, decode: Callable[[str, bytes], Any]) -> LatestView:
    """A KV bucket's current keys, decode(key, value) each; deleted and purged keys are absent."""
    store = names.kv(bucket)

    def value(key: str, msg) -> Any | None:
        if (msg.headers or {}).get(KV_OPERATION) in ("DEL", "PURGE") or not msg.data:
            return None
        return decode(key, msg.data)

    return LatestView(js, store.stream, store.subjects, value, key=lambda s: s.removeprefix(store.prefix))


def object_view(js, bucket: str) -> LatestView:
    """An object store's current objects as nats-py ObjectInfo, by name; deleted ones are absent."""

    def info(_key: str, msg) -> ObjectInfo | None:
        found = ObjectInfo.from_response(json.loads(msg.data))
        return None if found.deleted else found

    store = names.objects(bucket)
    return LatestView(js, store.stream, store.metas, info)
