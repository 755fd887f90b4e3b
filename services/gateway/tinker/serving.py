"""Serving samplers: what samples a tenant's stored sampler save once the session that saved it has ended. One per
tenant, base model and LoRA layout (rank and target modules: a save loads only into an adapter of its own shape),
it is a session job like a base model's sampler (placed like any, in the tenant's session group on a device with
the base, paused when idle and resumed by its next call), whose samples name the stored save to fetch on demand
(Sample.object). It belongs to no client session: it is made the first time it is needed and made again if its job
has ended (failed, cancelled), under its model record's revision, so concurrent gateways make one. It holds a
place in the tenant's max_models as a training model does (each sample through it makes sure of it: a 400 naming
the bound when it is full); the place is taken back, when the bound is full, once its job is paused or ended."""

from __future__ import annotations

import hashlib
import logging
import time

import msgspec

from schemas.jobs import Error
from schemas.job_status import JobReply
from schemas.sessions import SessionSpec
from schemas.tinker_store import ModelRecord, SamplerSave, model_key
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.bounds import SERVING, Bounds, Running
from services.gateway.tinker.common import session_job
from services.gateway.tinker.futures import CallFailed
from services.gateway.tinker.http import TinkerRefusal
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from services.gateway.tinker.trainers import TERMINAL, Trainers

log = logging.getLogger(__name__)


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
