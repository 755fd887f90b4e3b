"""What one tenant holds of each Tinker bound (client sessions, training models and base samplers, named sampler
saves), taken before the thing is made and given back when it ends: one record per tenant and bound
(schemas/tinker_store.py Holds) written only at the revision it was read at, so concurrent requests on any number of
gateways never take more places than the bound has. A place whose holder never came to be (its gateway died between
the hold and the record) or has ended is found out when the bound is full, and given back then; so are the places
of a session paused for silence, which is finished then (reaper.py's yield_silent)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

from schemas.tinker_store import (
    FutureRecord,
    Held,
    Holds,
    ModelRecord,
    SamplerSave,
    SessionRecord,
    call_key,
    holds_key,
    model_key,
    save_key,
    stored_name,
    session_key,
)
from services.gateway.tinker.http import TinkerRefusal
from services.gateway.tinker.paths import parse_path
from services.gateway.tinker.settings import TinkerSettings, limit
from services.gateway.tinker.store import CONTENDED_S, Store

GRACE_S = 60.0  # a place younger than this whose holder is not written yet is being made: it is not taken back
MODELS_FIX = "finish sessions you no longer use (ServiceClient.close(), or end the script)"
SERVING = ""  # the session of a serving sampler's place (serving.py): it belongs to no client session
Stale = Callable[[str, Held], Awaitable[bool]]  # (tenant, place): has its holder ended?
Running = Callable[[str, str], Awaitable[bool]]  # (tenant, job): does it hold a device, or wait for one?
Yields = Callable[[str, str], Awaitable[bool]]  # (tenant, session): its record says ended, or silent: finished now?


class Bounds:
    def __init__(self, store: Store, settings: TinkerSettings, running: Running | None = None) -> None:
        self.store, self.settings = store, settings
        self.running = running  # None: every serving sampler's job taken as running
        self.yields: Yields | None = None  # a session paused for silence gives its places up (reaper.py); None: not

    # --- each bound -----------------------------------------------------------------------------------------------
    async def session(self, tenant: str, session: str) -> None:
        """A place for a new session, or a 400 naming max_sessions."""
        held = Held(id=session, session=session, since=time.time())
        await self._take(tenant, "sessions", held, self.settings.max_sessions, self._session_gone,
                         "sessions open", "max_sessions",
                         "end sessions you no longer use (ServiceClient.close(), or end the script)")  # fmt: skip

    async def model(self, tenant: str, session: str, model: str) -> None:
        """A place for a training model or a base model's sampler (the same one again: its place already)."""
        held = Held(id=model, session=session, since=time.time())
        await self._take(tenant, "models", held, self.settings.max_models, self._model_gone,
                         "training models and samplers", "max_models", MODELS_FIX)  # fmt: skip

    async def sampler_save(self, tenant: str, session: str, path: str, request: str, expires: float | None) -> None:
        """A place for a named sampler save (saved again under its name: its place already)."""
        held = Held(id=path, session=session, since=time.time(), request=request, expires=expires)
        await self._take(tenant, "samplers", held, self.settings.max_sampler_saves, self._save_gone,
                         "named sampler saves", "max_sampler_saves",
                         "delete the ones you no longer need (RestClient.delete_checkpoint_from_tinker_path), or "
                         "save under a name you used before")  # fmt: skip

    async def end_session(self, tenant: str, session: str) -> None:
        """The session finished: its place and its models' places are given back (its sampler saves stay)."""
        for kind in ("sessions", "models"):
            await self.give_back(tenant, kind, lambda h: h.session == session)

    async def give_back(self, tenant: str, kind: str, which: Callable[[Held], bool]) -> None:
        def drop(holds: Holds) -> bool:
            kept = [h for h in holds.held if not which(h)]
            changed, holds.held = len(kept) != len(holds.held), kept
            return changed

        await self.store.modify(self.store.kv, holds_key(tenant, kind), Holds, drop)

    async def expire(self, tenant: str, path: str, expires: float | None) -> None:
        """A sampler save's new TTL, which its place follows."""

        def change(holds: Holds) -> bool:
            for h in holds.held:
                if h.id == path:
                    h.expires = expires
            return True

        await self.store.modify(self.store.kv, holds_key(tenant, "samplers"), Holds, change)

    # --- taking a place -------------------------------------------------------------------------------------------
    async def _take(self, tenant: str, kind: str, held: Held, bound: int, gone: Stale, what: str, flag: str,
                    fix: str) -> None:  # fmt: skip
        """The place taken, written at the revision read (again while others write); a 400 when the bound is full
        even after the places of holders that ended are taken back."""
        key, deadline, tries, checked = holds_key(tenant, kind), time.monotonic() + CONTENDED_S, 0, False
        ended: set[str] = set()
        while True:
            found = await self.store.get(self.store.kv, key, Holds)
            holds, revision = found if found is not None else (Holds(), None)
            now = time.time()
            live = [h for h in holds.held if (h.expires is None or h.expires > now) and h.id not in ended]
            same = next((h for h in live if h.id == held.id), None)
            if same is not None and same.expires == held.expires:
                return  # its place already
            if same is not None:  # saved again with another TTL: its place follows (counted already)
                live.remove(same)
            if len(live) >= bound and not checked:
                checked = True
                ended |= {h.id for h, out in zip(live, await asyncio.gather(*(gone(tenant, h) for h in live))) if out}
                ended |= await self._yield(tenant, [h for h in live if h.id not in ended], bound, held.session)
                live = [h for h in live if h.id not in ended]
            if len(live) >= bound:
                raise TinkerRefusal(400, limit(len(live), bound, what, flag, fix) or what)
            mine = Holds(held=[*live, held])
            if revision is None:
                written = await self.store.create(self.store.kv, key, mine)
            else:
                written = await self.store.update(self.store.kv, key, mine, revision)
            if written is not None:
                return
            tries += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"{key} changed {tries} times in {CONTENDED_S:.0f} s: the store is overloaded")
            await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** min(tries, 6))))

    async def _yield(self, tenant: str, live: list[Held], bound: int, asking: str) -> set[str]:
        """The places of sessions paused for silence, finished one at a time (yields) until the bound has one free:
        as many as are needed, never every silent session at once, and never the asking session's own."""
        freed: set[str] = set()
        for session in dict.fromkeys(h.session for h in live if h.session not in (SERVING, asking)):
            if len(live) - len(freed) < bound or self.yields is None:
                break
            if await self.yields(tenant, session):
                freed |= {h.id for h in live if h.session == session}
        return freed

    # --- has a place's holder ended? ------------------------------------------------------------------------------
    async def _session_ended(self, tenant: str, session: str) -> bool:
        found = await self.store.get(self.store.kv, session_key(tenant, session), SessionRecord)
        return found is None or found[0].finished is not None

    async def _session_gone(self, tenant: str, held: Held) -> bool:
        return await self._ended(tenant, held.session, time.time() - held.since < GRACE_S)

    async def _ended(self, tenant: str, session: str, young: bool) -> bool:
        """The session finished (a `young` place with no record yet is one being made). One paused for silence is
        not asked here: _yield finishes only as many as the bound needs."""
        return not young and await self._session_ended(tenant, session)

    async def _model_gone(self, tenant: str, held: Held) -> bool:
        young = time.time() - held.since < GRACE_S
        if held.session == SERVING:  # a serving sampler's: its job paused (idle) or ended; its next sample asks again
            if young:
                return False
            found = await self.store.get(self.store.kv, model_key(tenant, held.id), ModelRecord)
            return found is None or (self.running is not None and not await self.running(tenant, found[0].job))
        if await self._ended(tenant, held.session, young):
            return True
        return not young and await self.store.get(self.store.kv, model_key(tenant, held.id), ModelRecord) is None

    async def _save_gone(self, tenant: str, held: Held) -> bool:
        if time.time() - held.since < GRACE_S:
            return False
        model, kind, name = parse_path(held.id)
        if await self.store.get(self.store.kv, save_key(tenant, model, stored_name(kind, name)), SamplerSave):
            return False
        call = await self.store.get(self.store.futures, call_key(tenant, held.request), FutureRecord)
        return call is None or call[0].outcome is not None  # the call that was to make it failed, or is gone
