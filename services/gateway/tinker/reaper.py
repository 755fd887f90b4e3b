"""What becomes of sessions whose clients went quiet, every REAP_S on every gateway (a claim written with the
record's revision makes one gateway act, never two): a session with no heartbeat for the silence window is paused
(its jobs checkpoint and free their devices; the next call resumes them, as after an idle pause), one silent for
`end_s` is finished (its places in the tenant's bounds given back), and a finished one's records are deleted
`retention_s` after it finished. A session paused for silence keeps its places (its client may come back and go on)
until its tenant's bound needs one (bounds.py asks yield_silent): then it is finished at once, as at `end_s`. Named
sampler saves whose TTL passed are deleted too (saves.py), and serving samplers whose jobs paused are finished
(serving.py's sweep)."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from schemas.tinker_store import ModelRecord, SessionRecord, model_key, session_key
from services.gateway.tinker.bounds import Bounds
from services.gateway.tinker.futures import Book
from services.gateway.tinker.mirror import Mirror
from services.gateway.tinker.saves import Saves
from services.gateway.tinker.serving import SWEEP_S, sweep
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from services.gateway.tinker.trainers import Trainers

log = logging.getLogger(__name__)
REAP_S = 5.0


class Reaper:
    def __init__(
        self,
        store: Store,
        mirror: Mirror,
        book: Book,
        trainers: Trainers,
        settings: TinkerSettings,
        bounds: Bounds,
        saves: Saves,
    ) -> None:
        self.store, self.mirror, self.book, self.trainers, self.settings = store, mirror, book, trainers, settings
        self.bounds, self.saves = bounds, saves
        self._swept = time.monotonic()  # the serving samplers' last sweep

    async def run(self) -> None:
        while True:
            await asyncio.sleep(REAP_S)
            try:
                await self.once()
            except Exception:  # a round that failed is logged, and the next one runs
                log.exception("reaping Tinker sessions failed")

    async def once(self) -> None:
        now, settings = time.time(), self.settings
        for session, revision in list(self.mirror.sessions.values()):
            silent = now - session.heard
            if session.finished is not None:
                if now - session.finished > settings.retention_s:
                    await self.bounds.end_session(session.tenant, session.id)  # given back at its end already
                    await self.store.forget_session(session.tenant, session.id)
            elif silent > settings.end_s:
                why = f"no heartbeat for {silent:.0f} s"
                if await self._claim(session, revision, finished=now):
                    await self.end(session, why)
            elif silent > settings.silence_s and not session.paused:
                if await self._claim(session, revision, paused=True):
                    log.info("session %s of %s sent no heartbeat for %.0f s: pausing its jobs (the next call "
                             "resumes them)", session.id, session.tenant, silent)  # fmt: skip
                    await self._each_model(session, self.trainers.pause)
        self.book.sweep()
        await self.saves.sweep()
        if time.monotonic() - self._swept > min(SWEEP_S, settings.idle_s):  # a pause comes idle_s after a sample
            self._swept = time.monotonic()
            await sweep(self.store, self.trainers, self.bounds)

    async def yield_silent(self, tenant: str, session_id: str) -> bool:
        """Whether the session's record says it has ended, or it is paused for silence and so finished now: its
        tenant's bound needs its places (a client that comes back after this finds its session finished, as after
        end_s). False with no record (one being made, or long gone: bounds.py tells which)."""
        found = await self.store.get(self.store.kv, session_key(tenant, session_id), SessionRecord)
        if found is None:
            return False
        if found[0].finished is not None:
            return True
        session, revision = found
        silent = time.time() - session.heard
        if not session.paused or silent <= self.settings.silence_s:
            return False
        if not await self._claim(session, revision, finished=time.time()):
            return False  # a heartbeat came (or another gateway finished it first: the bound's next read sees it)
        await self.end(session, f"no heartbeat for {silent:.0f} s, and its tenant's bound needed its places")
        return True

    async def _claim(self, session: SessionRecord, revision: int, **changes) -> bool:
        """Whether this gateway's write of the change won (another gateway, or a heartbeat, may have come first)."""
        changed = msgspec.structs.replace(session, **changes)
        written = await self.store.update(self.store.kv, session_key(session.tenant, session.id), changed, revision)
        if written is not None:
            self.mirror.learn(changed, written)
        return written is not None

    async def end(self, session: SessionRecord, why: str) -> None:
        """Its running jobs stop and store their adapters; those of a session paused for silence (paused, or still
        pausing) are cancelled, their checkpoints staying in the store: a paused job cannot stop, and one stopped
        while its pause is under way could end paused, for ever."""
        log.info("session %s of %s finished: %s", session.id, session.tenant, why)
        await self.bounds.end_session(session.tenant, session.id)
        await self._each_model(session, self.trainers.cancel_model if session.paused else self.trainers.stop)

    async def _each_model(self, session: SessionRecord, act) -> None:
        for model_id in session.models:
            try:
                found = await self.store.get(self.store.kv, model_key(session.tenant, model_id), ModelRecord)
                if found is not None:
                    await act(found[0])
            except Exception as e:  # the scheduler away: the next call or the idle pause sees to it
                log.warning("session %s: model %s not reached (%s)", session.id, model_id, e)
