"""Serving samplers: what samples a tenant's stored sampler save once the session that saved it has ended. One per
tenant, base model and LoRA layout (rank and target modules: a save loads only into an adapter of its own shape),
it is a session job like a base model's sampler (placed like any, in the tenant's session group on a device with
the base, paused when idle and resumed by its next call), whose samples name the stored save to fetch on demand
(Sample.object). It belongs to no client session: it is made the first time it is needed and made again if its job
has ended (failed, cancelled), under its model record's revision, so concurrent gateways make one. It holds a
place in the tenant's max_models as a training model does (each sample through it makes sure of it: a 400 naming
the bound when it is full). A serving sampler holds nothing worth keeping (its saves are in the object store), so
one whose job paused (idle for idle_s) is finished, its job cancelled and its place given back, by the reaper's
sweep every SWEEP_S (on every gateway: the record is deleted at the revision read, so two gateways finish it once);
one whose job ended has its place given back the same way. Its next sample makes it again."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
import logging
import time

import msgspec
from nats.js.errors import KeyWrongLastSequenceError

from schemas.jobs import Error
from schemas.job_status import JobReply
from schemas.sessions import SessionSpec
from schemas.tinker_store import Held, Holds, ModelRecord, SamplerSave, holds_key, model_key
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.bounds import GRACE_S, SERVING, Bounds, Running
from services.gateway.tinker.common import session_job
from services.gateway.tinker.futures import CallFailed
from services.gateway.tinker.http import TinkerRefusal
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from services.gateway.tinker.trainers import TERMINAL, Trainers

log = logging.getLogger(__name__)
SWEEP_S = 30.0  # how often the serving samplers of every tenant are looked at


def layout(save: SamplerSave, idle_s: float) -> SessionSpec:
    return SessionSpec(rank=save.rank, train_attn=save.train_attn, train_mlp=save.train_mlp,
                       train_unembed=save.train_unembed, idle_s=idle_s)  # fmt: skip


def serving_id(base_model: str, spec: SessionSpec) -> str:
    shape = f"{base_model}|{spec.rank}|{spec.train_attn}|{spec.train_mlp}|{spec.train_unembed}"
    return f"serve-{hashlib.sha256(shape.encode()).hexdigest()[:16]}:base:0"


def job_running(trainers: Trainers) -> Running:
    """Whether a serving sampler's job holds a device or waits for one (not paused, not ended): while it does, its
    place in max_models is not taken back (bounds.py)."""

    async def running(tenant: str, job: str) -> bool:
        reply = await trainers.watch.job(tenant, job)
        return isinstance(reply, JobReply) and reply.job.state not in (*TERMINAL, "paused")

    return running


def local_name(save: SamplerSave) -> str:
    """The save's name on a serving sampler's node (saves of several jobs share its directory)."""
    return f"{save.job}--{save.name}"


class Serving:
    def __init__(self, store: Store, trainers: Trainers, models: dict[str, BaseModel], settings: TinkerSettings,
                 bounds: Bounds) -> None:  # fmt: skip
        self.store, self.trainers, self.models, self.settings, self.bounds = store, trainers, models, settings, bounds

    async def model(self, save: SamplerSave) -> ModelRecord:
        """The tenant's serving sampler for the save's base and layout, made (or made again) if need be."""
        base = self.models.get(save.base_model)
        if base is None:
            raise TinkerRefusal(400, f"{save.path}: its base model {save.base_model!r} is no longer served here")
        spec = layout(save, self.settings.idle_s)
        model_id, tenant = serving_id(save.base_model, spec), save.tenant
        await self.bounds.model(tenant, SERVING, model_id)  # a job on a device: a place of max_models (a 400 if full)
        found = await self.store.get(self.store.kv, model_key(tenant, model_id), ModelRecord)
        if found is not None and not await self._ended(found[0]):
            return found[0]
        job = session_job(base, spec, model_id)
        job.idempotency_key = f"tinker {model_id} {time.time_ns()}"  # a job made again is a new job
        job.label = f"tinker serving sampler of {save.base_model} (rank {spec.rank})"
        try:
            job_id = await self.trainers.submit(tenant, job)
        except CallFailed as e:
            raise TinkerRefusal(400, f"{save.path}: no sampler could be started for it: {e}") from None
        now = time.time()
        record = ModelRecord(id=model_id, tenant=tenant, session="", base_model=base.name, kind="base", job=job_id,
                             spec=spec, next_seq=1, created=now, last_request=now)  # fmt: skip
        if found is None:
            written = await self.store.create(self.store.kv, model_key(tenant, model_id), record)
        else:
            written = await self.store.update(self.store.kv, model_key(tenant, model_id), record, found[1])
        if written is None:  # another gateway made it first: its job serves, this one goes
            await self.trainers.cancel(tenant, job_id)
            again = await self.store.get(self.store.kv, model_key(tenant, model_id), ModelRecord)
            if again is None:
                raise TinkerRefusal(409, f"{save.path}: its sampler was being made elsewhere; sample again")
            return again[0]
        self.trainers.routes.pop(model_id, None)  # the calls go to the new job
        log.info("tenant %s: serving sampler %s started as job %s", tenant, model_id, job_id)
        return msgspec.structs.replace(record)

    async def _ended(self, model: ModelRecord) -> bool:
        reply = await self.trainers.watch.job(model.tenant, model.job)
        return isinstance(reply, Error) or (isinstance(reply, JobReply) and reply.job.state in TERMINAL)


async def sweep(store: Store, trainers: Trainers, bounds: Bounds) -> int:
    """Every tenant's serving samplers whose jobs are paused are finished (the record deleted at the revision read,
    so a sample that made it again meanwhile keeps its own; then the job cancelled), and the places of those paused
    or ended given back. How many places went back."""
    given = 0
    for key, holds, _ in await store.scan_keyed(store.kv, holds_key("*", "models"), Holds):
        tenant = key.split(".")[1]
        for held in [h for h in holds.held if h.session == SERVING]:
            if await _finished(store, trainers, tenant, held.id, time.time() - held.since > GRACE_S):
                await bounds.give_back(tenant, "models", _the(held.id))
                given += 1
    return given


def _the(model_id: str) -> Callable[[Held], bool]:
    return lambda h: h.session == SERVING and h.id == model_id


async def _finished(store: Store, trainers: Trainers, tenant: str, model_id: str, old: bool) -> bool:
    """Whether the serving sampler holds no device any more: paused (finished now) or ended, or never made (`old`:
    its place older than a record takes to be written)."""
    found = await store.get(store.kv, model_key(tenant, model_id), ModelRecord)
    if found is None:
        return old
    record, revision = found
    reply = await trainers.watch.job(tenant, record.job)
    if isinstance(reply, Error) or (isinstance(reply, JobReply) and reply.job.state in TERMINAL):
        return True
    if not isinstance(reply, JobReply) or reply.job.state != "paused":
        return False
    try:
        await store.kv.delete(model_key(tenant, model_id), last=revision)
    except KeyWrongLastSequenceError:  # a sample made it again just now: that one serves
        return False
    await trainers.cancel(tenant, record.job)
    trainers.watch.forget(record.job)
    log.info("tenant %s: serving sampler %s (job %s) finished: its job was paused, idle", tenant, model_id, record.job)
    return True
