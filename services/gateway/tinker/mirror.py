"""What every gateway follows of the Tinker buckets as they change: the gateways that are up (a model's calls run
on one of them while it stays up), every session (the silent ones to pause, a tenant's listed), and the keys of
the calls written (a call another gateway took for a model whose calls run here, or an outcome a client waits for
here). Each is one ordered consumer for the gateway's whole life, never one per request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.js.api import DeliverPolicy

from schemas import names, nats_subjects
from schemas.tinker_store import LIVE_S, GatewayRecord, SessionRecord, gateway_key, ident
from services.gateway.tinker.store import Store

log = logging.getLogger(__name__)
GONE_OPS = ("DEL", "PURGE")
READY_S = 10.0


def _operation(msg) -> str:
    headers = msg.headers or {}
    if "Nats-Marker-Reason" in headers:  # nats-server 2.11+: an entry removed by its age
        return "PURGE"
    return headers.get("KV-Operation", "PUT")


class Mirror:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.on_call: Callable[[str, str], None] = lambda tenant, request: None  # every call key written
        self.heard: dict[str, float] = {}  # gateway -> when this gateway last saw it write its record (monotonic)
        self.sessions: dict[str, tuple[SessionRecord, int]] = {}  # session id -> its record and revision
        self._subs: list = []

    async def start(self) -> None:
        kv, futures = nats_subjects.kv(names.TINKER_KV), nats_subjects.kv(names.TINKER_FUTURES_KV)
        ready = [asyncio.Event(), asyncio.Event()]
        for n, (subject, handle) in enumerate(
            ((kv.prefix + gateway_key(), self._gateway), (kv.prefix + "session.>", self._session))
        ):
            self._subs.append(await self._follow(kv.stream, subject, handle, ready[n]))
        self._subs.append(
            await self.store.js.subscribe(
                futures.prefix + "call.>",
                stream=futures.stream,
                cb=self._call,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.NEW,  # what is written from now on; older calls are read when asked for
                headers_only=True,
            )
        )
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), READY_S)

    async def _follow(self, stream: str, subject: str, handle, ready: asyncio.Event):
        async def cb(msg) -> None:
            try:
                handle(msg.subject.removeprefix(nats_subjects.kv(names.TINKER_KV).prefix), msg)
            except Exception:  # one record that does not decode: said, and the mirror goes on
                log.exception("a Tinker record on %s did not decode", msg.subject)
            if msg.metadata.num_pending == 0:
                ready.set()

        sub = await self.store.js.subscribe(
            subject, stream=stream, cb=cb, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
        )
        if (await sub.consumer_info()).num_pending == 0 and sub.delivered == 0:
            ready.set()
        return sub

    def _gateway(self, key: str, msg) -> None:
        gateway = key.removeprefix("gateway.")
        if _operation(msg) in GONE_OPS or not msg.data:
            self.heard.pop(gateway, None)
        else:
            self.store.decode(GatewayRecord, msg.data)
            self.heard[gateway] = time.monotonic()

    def _session(self, key: str, msg) -> None:
        session = ident(key.split(".", 2)[2])
        if _operation(msg) in GONE_OPS or not msg.data:
            self.sessions.pop(session, None)
        else:
            self.sessions[session] = (self.store.decode(SessionRecord, msg.data), msg.metadata.sequence.stream)

    async def _call(self, msg) -> None:
        parts = msg.subject.removeprefix(nats_subjects.kv(names.TINKER_FUTURES_KV).prefix).split(".", 2)
        if len(parts) == 3 and _operation(msg) not in GONE_OPS:
            self.on_call(parts[1], ident(parts[2]))

    def alive(self, gateway: str) -> bool:
        heard = self.heard.get(gateway)
        return heard is not None and time.monotonic() - heard < LIVE_S

    def session(self, tenant: str, session: str) -> tuple[SessionRecord, int] | None:
        found = self.sessions.get(session)
        return found if found is not None and found[0].tenant == tenant else None

    def learn(self, record: SessionRecord, revision: int) -> None:
        """A session this gateway just wrote (its own write comes back on the consumer a moment later)."""
        current = self.sessions.get(record.id)
        if current is None or current[1] < revision:
            self.sessions[record.id] = (record, revision)

    async def close(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as e:  # the connection already closing: nothing to give back
                log.debug("unsubscribing a Tinker mirror: %s", e)
        self._subs.clear()


class Liveness:
    """This gateway's record in names.TINKER_KV, written every LIVE_S / 3 while it is up and deleted when it
    closes: the models whose calls it runs are taken over at once then, or LIVE_S after it died."""

    def __init__(self, store: Store, gateway: str) -> None:
        self.store, self.gateway = store, gateway

    async def beat(self) -> None:
        await self.store.put(
            self.store.kv, gateway_key(self.gateway), GatewayRecord(id=self.gateway, started=time.time())
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(LIVE_S / 3)
            try:
                await self.beat()
            except Exception as e:  # the server away a moment: the next beat tries again
                log.warning("the gateway's liveness record was not written (%s)", e)

    async def end(self) -> None:
        await self.store.delete(self.store.kv, gateway_key(self.gateway))
