"""What becomes of sessions whose clients went quiet, every REAP_S on every gateway (a claim written with the
record's revision makes one gateway act, never two): a session with no heartbeat for the silence window is paused
(its jobs checkpoint and free their devices; the next call resumes them, as after an idle pause), one silent for
`end_s` is finished (its places in the tenant's bounds given back), and a finished one's records are deleted
`retention_s` after it finished. Named sampler saves whose TTL passed are deleted too (saves.py)."""

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

    async def _claim(self, session: SessionRecord, revision: int, **changes) -> bool:
        """Whether this gateway's write of the change won (another gateway, or a heartbeat, may have come first)."""
        changed = msgspec.structs.replace(session, **changes)
        written = await self.store.update(self.store.kv, session_key(session.tenant, session.id), changed, revision)
        if written is not None:
            self.mirror.learn(changed, written)
        return written is not None

    async def end(self, session: SessionRecord, why: str) -> None:
        """Its running jobs stop and store their adapters (a paused one stays paused, its checkpoint stored)."""
        log.info("session %s of %s finished: %s", session.id, session.tenant, why)
        await self.bounds.end_session(session.tenant, session.id)
        await self._each_model(session, self.trainers.stop)

    async def _each_model(self, session: SessionRecord, act) -> None:
        for model_id in session.models:
            try:
                found = await self.store.get(self.store.kv, model_key(session.tenant, model_id), ModelRecord)
                if found is not None:
                    await act(found[0])
            except Exception as e:  # the scheduler away: the next call or the idle pause sees to it
                log.warning("session %s: model %s not reached (%s)", session.id, model_id, e)
