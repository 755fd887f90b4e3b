"""The Tinker API's buckets (schemas/tinker_store.py) as the gateway uses them: typed reads and writes, writes that
hold only if nobody wrote in between (a revision, or none for a key that must not exist yet), a value too large for
a KV entry kept as an object, and one session's records deleted at once."""

from __future__ import annotations

import asyncio
import io
import random
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from schemas import names, nats_subjects
from schemas.tinker_store import session_records
from services.runtime import StartupError

T = TypeVar("T")
_encode = msgspec.json.Encoder().encode
HEADROOM = 16 * 1024  # what a KV entry's subject and headers may take of a message
CONTENDED_S = 20.0  # a record written by many requests at once is read and changed again for this long at most


class Store:
    """kv: sessions, models, samplers and gateways; futures: calls and their outcomes; results: large values."""

    def __init__(self, nc) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.max_value = max(4096, nc.max_payload - HEADROOM)
        self._decoders: dict[type, msgspec.json.Decoder] = {}

    async def open(self) -> Store:
        try:
            self.kv = await self.js.key_value(names.TINKER_KV)
            self.futures = await self.js.key_value(names.TINKER_FUTURES_KV)
            self.results = await self.js.object_store(names.TINKER_RESULTS_BUCKET)
        except NotFoundError:
            raise StartupError(
                f"the Tinker API's buckets ({names.TINKER_KV}, {names.TINKER_FUTURES_KV}, "
                f"{names.TINKER_RESULTS_BUCKET}) do not exist on this NATS server yet: start this version's scheduler "
                "first (it creates them), or `jetlora up`"
            ) from None
        return self

    def decode(self, kind: type[T], raw: bytes) -> T:
        decoder = self._decoders.get(kind)
        if decoder is None:
            decoder = self._decoders[kind] = msgspec.json.Decoder(kind)
        return decoder.decode(raw)

    async def get(self, kv, key: str, kind: type[T]) -> tuple[T, int] | None:
        """The record and its revision, or None."""
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return self.decode(kind, entry.value), entry.revision

    async def put(self, kv, key: str, record) -> int:
        return await kv.put(key, _encode(record))

    async def create(self, kv, key: str, record) -> int | None:
        """Written if the key holds nothing yet; None if it does."""
        return await self.create_raw(kv, key, _encode(record))

    async def create_raw(self, kv, key: str, data: bytes) -> int | None:
        try:
            return await kv.create(key, data)
        except KeyWrongLastSequenceError:
            return None

    async def update(self, kv, key: str, record, revision: int) -> int | None:
        """Written if the key is still at `revision`; None if someone wrote in between."""
        try:
            return await kv.update(key, _encode(record), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def modify(self, kv, key: str, kind: type[T], change: Callable[[T], bool]) -> T | None:
        """Read, change (False: leave it as it is) and write back, again (after a short random wait, longer each
        time) while another request or gateway wrote in between: contention is this gateway's to wait out, never
        the client's; the record as written (None: there is none)."""
        deadline, tries = time.monotonic() + CONTENDED_S, 0
        while True:
            found = await self.get(kv, key, kind)
            if found is None:
                return None
            record, revision = found
            if not change(record) or await self.update(kv, key, record, revision) is not None:
                return record
            tries += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"{key} changed {tries} times in {CONTENDED_S:.0f} s while this gateway tried to "
                                   "write it: the store is overloaded")  # fmt: skip
            await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** min(tries, 6))))

    async def scan(self, kv, keys: str, kind: type[T]) -> list[T]:
        """Every record under a key filter (a listing: one consumer for the whole of it)."""
        watcher = await kv.watch(keys, ignore_deletes=True)
        out = []
        try:
            while (entry := await watcher.updates(timeout=10.0)) is not None:
                if entry.value:
                    out.append(self.decode(kind, entry.value))
        finally:
            await watcher.stop()
        return out

    async def scan_keyed(self, kv, keys: str, kind: type[T]) -> list[tuple[str, T, int]]:
        """scan's records with their keys and revisions."""
        watcher = await kv.watch(keys, ignore_deletes=True)
        out = []
        try:
            while (entry := await watcher.updates(timeout=10.0)) is not None:
                if entry.value:
                    out.append((entry.key, self.decode(kind, entry.value), entry.revision))
        finally:
            await watcher.stop()
        return out

    async def delete(self, kv, key: str) -> None:
        await kv.purge(key)

    async def put_object(self, name: str, data: bytes) -> None:
        await self.results.put(name, data)

    async def get_object(self, name: str) -> bytes | None:
        out = io.BytesIO()
        try:
            await self.results.get(name, writeinto=out)  # nats-py's get without writeinto is quadratic
        except NotFoundError:
            return None
        return out.getvalue()

    async def forget_session(self, tenant: str, session: str) -> None:
        """Every record of the session, in both buckets (its large results go with the bucket's age)."""
        *main, calls = session_records(tenant, session)
        await self.kv.purge(main[0])  # a marker, so every gateway's mirror of sessions drops it
        for pattern in main[1:]:
            await self.js.purge_stream(
                nats_subjects.kv(names.TINKER_KV).stream, subject=nats_subjects.kv(names.TINKER_KV).prefix + pattern
            )
        await self.js.purge_stream(
            nats_subjects.kv(names.TINKER_FUTURES_KV).stream,
            subject=nats_subjects.kv(names.TINKER_FUTURES_KV).prefix + calls,
        )
