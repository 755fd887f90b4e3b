"""The Tinker API's futures: every training or sampling call is stored (names.TINKER_FUTURES_KV) before the client
is given its request id, and its outcome is stored when it is done, so any gateway answers retrieve_future. A fetch
waits for the outcome up to HOLD_S (a long poll), then answers 408 and the client asks again: from memory where the
call runs on this gateway, else woken by the key's write (mirror.py) and read from the store."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import msgspec

from schemas.sessions import SessionCall
from schemas.tinker_store import FutureRecord, Outcome, call_key
from services.gateway.tinker.store import Store

log = logging.getLogger(__name__)
HOLD_S = 25.0  # under the client's 45 s timeout on retrieve_future
KEPT_S = 60.0  # an outcome stays in memory this long after it is done (then the store answers)
REVIVE_S = 5.0  # a fetch waiting on another gateway's call makes sure again this often that a live gateway runs it
_encode = msgspec.json.Encoder().encode


class CallFailed(Exception):
    """A call that failed after it was accepted: the client raises RequestFailedError with this message."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.category = category


def failed(message: str, category: str = "user") -> Outcome:
    return Outcome(json={"error": message, "category": category})


@dataclass
class Local:
    """A future this gateway runs: its outcome, awaited by the fetches that come here."""

    tenant: str
    done: asyncio.Future
    finished: float | None = None


class Book:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.local: dict[str, Local] = {}
        self.waiting: dict[str, list[asyncio.Event]] = {}  # fetches here of futures another gateway runs
        self.pending: collections.Counter[str] = collections.Counter()  # per tenant: futures run here, not done

    async def record(self, future: FutureRecord) -> FutureRecord | None:
        """Store a new call (a large one's body as an object); None if its key holds one already (sent again)."""
        data = _encode(future)
        if len(data) > self.store.max_value and future.call is not None:
            name = f"{future.tenant}/{future.id}.call"
            await self.store.put_object(name, _encode(future.call))
            future = msgspec.structs.replace(future, call=None, call_object=name)
            data = _encode(future)
        if await self.store.create_raw(self.store.futures, call_key(future.tenant, future.id), data) is None:
            return None
        return future

    async def find(self, tenant: str, request: str) -> FutureRecord | None:
        found = await self.store.get(self.store.futures, call_key(tenant, request), FutureRecord)
        return found[0] if found is not None else None

    async def call_of(self, future: FutureRecord):
        if future.call is not None or not future.call_object:
            return future.call
        raw = await self.store.get_object(future.call_object)
        if raw is None:
            return None
        return self.store.decode(SessionCall, raw)  # type: ignore[arg-type]  # a union of tagged Structs

    def expect(self, future: FutureRecord) -> None:
        """This gateway runs it: its fetches here wait on memory."""
        if future.id not in self.local:
            self.local[future.id] = Local(future.tenant, asyncio.get_running_loop().create_future())
            self.pending[future.tenant] += 1

    async def finish(self, future: FutureRecord, outcome: Outcome) -> None:
        """Store its outcome (a large body as an object), then answer the fetches waiting here."""
        if outcome.body is not None and len(outcome.body) > self.store.max_value // 2:
            name = f"{future.tenant}/{future.id}"
            await self.store.put_object(name, outcome.body)
            stored = Outcome(object=name, protobuf=True)
        else:
            stored = outcome
        done = msgspec.structs.replace(future, call=None, call_object="", job=None, outcome=stored)
        await self.store.put(self.store.futures, call_key(future.tenant, future.id), done)
        self.resolve(future.id, outcome)

    def resolve(self, request: str, outcome: Outcome) -> None:
        local = self.local.get(request)
        if local is not None and not local.done.done():
            local.done.set_result(outcome)
            local.finished = time.monotonic()
            self.pending[local.tenant] -= 1
            if self.pending[local.tenant] <= 0:
                del self.pending[local.tenant]

    def abandon(self, request: str) -> None:
        """It no longer runs here (this gateway closes): its fetches go to the store."""
        local = self.local.pop(request, None)
        if local is not None and not local.done.done():
            local.done.cancel()
            self.pending[local.tenant] -= 1
            if self.pending[local.tenant] <= 0:
                del self.pending[local.tenant]

    def written(self, request: str) -> None:
        """The key of `request` was written (by any gateway): a fetch here waiting on it looks again."""
        for event in self.waiting.get(request, ()):
            event.set()

    async def from_memory(self, tenant: str, request: str) -> tuple[bool, Outcome | None]:
        """(known here, its outcome or None if not done within HOLD_S)."""
        local = self.local.get(request)
        if local is None or local.tenant != tenant:
            return False, None
        try:
            return True, await asyncio.wait_for(asyncio.shield(local.done), HOLD_S)
        except asyncio.TimeoutError:
            return True, None
        except asyncio.CancelledError:
            if local.done.cancelled():  # abandoned while this fetch waited: the store answers the next
                return True, None
            raise

    async def from_store(self, future: FutureRecord, revive) -> Outcome | None:
        """The stored outcome, waiting up to HOLD_S for another gateway to write it; `revive` makes sure a live
        gateway runs it, first and every REVIVE_S (the one that ran it may be found gone meanwhile)."""
        event = asyncio.Event()
        self.waiting.setdefault(future.id, []).append(event)
        try:
            await revive(future)
            deadline = time.monotonic() + HOLD_S
            while True:
                if future.outcome is not None:
                    return await self.read(future.outcome)
                if future.id in self.local:  # taken over here just now
                    return (await self.from_memory(future.tenant, future.id))[1]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                event.clear()
                try:
                    await asyncio.wait_for(event.wait(), min(left, REVIVE_S))
                except asyncio.TimeoutError:
                    if left <= REVIVE_S:
                        return None
                    await revive(future)
                again = await self.find(future.tenant, future.id)
                if again is None:
                    raise KeyError(future.id)
                future = again
        finally:
            events = self.waiting.get(future.id, [])
            if event in events:
                events.remove(event)
            if not events:
                self.waiting.pop(future.id, None)

    async def read(self, outcome: Outcome) -> Outcome:
        if not outcome.object:
            return outcome
        body = await self.store.get_object(outcome.object)
        if body is None:
            return failed("this call's result is no longer kept (results are kept a day)", "server")
        return Outcome(body=body) if outcome.protobuf else Outcome(json=msgspec.json.decode(body))

    def sweep(self) -> None:
        """Outcomes done KEPT_S ago leave memory (the store keeps them)."""
        now = time.monotonic()
        for request, local in list(self.local.items()):
            if local.finished is not None and now - local.finished > KEPT_S:
                del self.local[request]
