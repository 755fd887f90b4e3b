"""Named sampler saves as the gateways keep them (schemas/tinker_store.py SamplerSave): recorded once the session's
node has stored the adapter in the object store, listed with their run's checkpoints, found by their tinker:// path
whether or not their session still lives, and deleted (the record, the object and the save's place in the
tenant's bound) when the client deletes one or its TTL passes (swept every SWEEP_S by one gateway)."""

from __future__ import annotations

import logging
import re
import time

from nats.js.errors import KeyWrongLastSequenceError

from schemas import names
from schemas.artifacts import ArtifactQuery, Deleted
from schemas.jobs import Error
from schemas.sessions import SAVED_NAME, SavedResult
from schemas.tinker_store import ModelRecord, SamplerSave, save_key, saves_of, stored_name, valid_id
from services import bus
from services.gateway.tinker.bounds import Bounds
from services.gateway.tinker.paths import parse_path, tinker_path
from services.gateway.tinker.store import Store

log = logging.getLogger(__name__)
SWEEP_S = 300.0


def live(save: SamplerSave, now: float | None = None) -> bool:
    return save.expires is None or save.expires > (now or time.time())


class Saves:
    def __init__(self, store: Store, bounds: Bounds) -> None:
        self.store, self.bounds = store, bounds
        self.swept = 0.0

    async def record(
        self, model: ModelRecord, saved: SavedResult, expires: float | None, path: str = "", age: tuple[str, ...] = ()
    ) -> SamplerSave:
        """What the node stored, under the save's name (a name saved again: the latest); `path`: an export's, and
        `age` the recipients its files are encrypted to when served."""
        save = SamplerSave(path=path or tinker_path(model.id, "sampler_weights", saved.name), tenant=model.tenant,
                           model=model.id, session=model.session, name=saved.name, job=model.job,
                           base_model=model.base_model, rank=model.spec.rank if model.spec else 0,
                           train_attn=model.spec.train_attn if model.spec else True,
                           train_mlp=model.spec.train_mlp if model.spec else True,
                           train_unembed=model.spec.train_unembed if model.spec else False,
                           object=saved.object, sha256=saved.sha256, size=saved.size, step=saved.step,
                           time=time.time(), expires=expires, age_recipients=list(age))  # fmt: skip
        await self.store.put(self.store.kv, save_key(model.tenant, model.id, saved.name), save)
        return save

    async def find(self, tenant: str, path: str) -> SamplerSave | None:
        """The tenant's live save at a tinker://<model>/sampler_weights/<name> path (None: none, or expired)."""
        model, kind, name = parse_path(path)
        if kind not in ("sampler_weights", "external_weights"):  # an export is a stored save too (exports.py)
            return None
        if not valid_id(model) or not re.fullmatch(SAVED_NAME, name):  # no save's: never a key to look up
            return None
        found = await self.store.get(self.store.kv, save_key(tenant, model, stored_name(kind, name)), SamplerSave)
        return found[0] if found is not None and live(found[0]) else None

    async def of(self, tenant: str, model: str | None = None) -> list[SamplerSave]:
        """The tenant's live saves (one model's), oldest first."""
        saves = await self.store.scan(self.store.kv, saves_of(tenant, model), SamplerSave)
        now = time.time()
        return sorted((s for s in saves if live(s, now)), key=lambda s: s.time)

    async def expire(self, save: SamplerSave, expires: float | None) -> None:
        def change(s: SamplerSave) -> bool:
            s.expires = expires
            return True

        await self.store.modify(self.store.kv, save_key(save.tenant, save.model, save.name), SamplerSave, change)
        await self.bounds.expire(save.tenant, save.path, expires)

    async def delete(self, save: SamplerSave, revision: int | None = None) -> bool:
        """The record (at `revision`, if given: False when another gateway changed or deleted it first), then the
        save's place and its object."""
        key = save_key(save.tenant, save.model, save.name)
        try:
            await self.store.kv.delete(key, last=revision)
        except KeyWrongLastSequenceError:
            return False
        await self.bounds.give_back(save.tenant, "samplers", lambda h: h.id == save.path)
        if save.object:
            query = ArtifactQuery(job=save.job, kind="sampler", name=save.object)
            try:
                answer = await bus.request(
                    self.store.nc, names.artifacts_api(save.tenant).delete, query, Deleted | Error
                )
            except bus.RequestError as e:  # the artifact service away: the object stays (`jetlora artifacts rm`)
                answer = Error(str(e))
            if isinstance(answer, Error):
                log.warning("sampler save %s: its object %s was not deleted (%s); the save is gone all the same",
                            save.path, save.object, answer.error)  # fmt: skip
        return True

    async def sweep(self) -> None:
        """Every tenant's saves whose TTL passed, at most every SWEEP_S (each deleted by one gateway)."""
        if time.monotonic() - self.swept < SWEEP_S:
            return
        self.swept = time.monotonic()
        now = time.time()
        for save in await self.store.scan(self.store.kv, "save.>", SamplerSave):
            if live(save, now):
                continue
            found = await self.store.get(self.store.kv, save_key(save.tenant, save.model, save.name), SamplerSave)
            if found is not None and not live(found[0], now) and await self.delete(found[0], found[1]):
                log.info("sampler save %s of %s: its TTL passed; deleted", save.path, save.tenant)
