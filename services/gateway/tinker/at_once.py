"""Calls that need no order (samples): each runs at once on the gateway that took it, its record naming that gateway
(`worker`); a fetch that finds the call not done and its gateway gone runs it here, under the same call id (a node
answers a repeat it still remembers, never runs it twice)."""

from __future__ import annotations

import asyncio
import logging

from schemas.tinker_store import FutureRecord, ModelRecord, call_key, model_key
from services.gateway.tinker.futures import Book
from services.gateway.tinker.mirror import Mirror
from services.gateway.tinker.outcomes import Runner
from services.gateway.tinker.store import Store

log = logging.getLogger(__name__)


class AtOnce:
    def __init__(self, store: Store, mirror: Mirror, book: Book, runner: Runner, gateway: str) -> None:
        self.store, self.mirror, self.book, self.runner, self.gateway = store, mirror, book, runner, gateway
        self.running: dict[str, asyncio.Task] = {}  # by request id

    def run(self, future: FutureRecord, model: ModelRecord) -> None:
        self.book.expect(future)
        self.running[future.id] = asyncio.create_task(self._run(future, model))

    async def _run(self, future: FutureRecord, model: ModelRecord) -> None:
        try:
            outcome, _ = await self.runner.run(future, model)
            await self.book.finish(future, outcome)
        except Exception:  # the store away: another gateway takes it over when its client asks
            log.exception("Tinker call %s: its outcome was not stored", future.id)
            self.book.abandon(future.id)
        finally:
            self.running.pop(future.id, None)

    async def revive(self, future: FutureRecord, model: ModelRecord | None) -> None:
        """Run it here if no live gateway does (`model`: this gateway's copy of its model, if it has one)."""
        if future.id in self.running or (future.worker and self.mirror.alive(future.worker)):
            return
        key = call_key(future.tenant, future.id)
        found = await self.store.get(self.store.futures, key, FutureRecord)
        if found is None or found[0].outcome is not None:
            return
        taken, revision = found
        taken.worker = self.gateway
        if model is None:
            stored = await self.store.get(self.store.kv, model_key(future.tenant, future.model), ModelRecord)
            model = stored[0] if stored is not None else None
        if model is not None and await self.store.update(self.store.futures, key, taken, revision) is not None:
            log.info("Tinker call %s: its gateway %s is gone; running it here", future.id, future.worker)
            self.run(taken, model)

    async def close(self) -> None:
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
