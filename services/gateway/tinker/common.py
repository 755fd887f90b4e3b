"""What the Tinker routes share: the gateway's parts (Ctx), the caller's own session, model and sampler (a 404
for what is not the caller's), the session job of a training model, and a body's values checked as a schema's
Struct (a 400 naming the field, numbers finite)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from schemas.jobs import JobRequest
from schemas.sessions import SessionSpec
from schemas.tinker_store import (
    ModelRecord,
    SamplerRecord,
    SessionRecord,
    model_key,
    sampler_key,
    session_key,
    valid_id,
)
from services.gateway.keys import KeyStore
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.bounds import Bounds
from services.gateway.tinker.futures import Book
from services.gateway.tinker.http import TinkerRefusal, field, tenant_of
from services.gateway.tinker.mirror import Mirror
from services.gateway.tinker.order import Order
from services.gateway.tinker.saves import Saves
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from services.gateway.tinker.trainers import Trainers

T = TypeVar("T")
PREFIX = "/api/v1"


@dataclass
class Ctx:
    gateway: str
    keys: KeyStore
    models: dict[str, BaseModel]
    settings: TinkerSettings
    store: Store
    mirror: Mirror
    book: Book
    order: Order
    trainers: Trainers
    bounds: Bounds
    saves: Saves

    async def tenant(self, request) -> str:
        return await tenant_of(request, self.keys)

    async def session(self, tenant: str, session_id: object, where: str = "session_id") -> tuple[SessionRecord, int]:
        """The caller's session and its revision (404 if it is none of its own)."""
        found = self.mirror.session(tenant, session_id) if isinstance(session_id, str) else None
        if found is None and valid_id(session_id):
            found = await self.store.get(self.store.kv, session_key(tenant, str(session_id)), SessionRecord)
        if found is None:
            raise TinkerRefusal(404, f"no session {_shown(session_id)} of yours: create_session first ({where})")
        return found

    async def model(self, tenant: str, model_id: object, where: str = "model_id") -> ModelRecord:
        """The caller's model: this gateway's copy where it runs the model's calls, else the store's."""
        model = self.order.model(model_id) if isinstance(model_id, str) else None
        if model is None and valid_id(model_id):
            found = await self.store.get(self.store.kv, model_key(tenant, str(model_id)), ModelRecord)
            model = found[0] if found is not None else None
        if model is None or model.tenant != tenant:
            raise TinkerRefusal(404, f"no training model {_shown(model_id)} of yours ({where})")
        return model

    async def sampler(self, tenant: str, sampler_id: object) -> SamplerRecord:
        found = None
        if valid_id(sampler_id):
            found = await self.store.get(self.store.kv, sampler_key(tenant, str(sampler_id)), SamplerRecord)
        if found is None:
            raise TinkerRefusal(404, f"no sampling session {_shown(sampler_id)} of yours")
        return found[0]

    def base(self, data: dict) -> BaseModel:
        name = field(data, "base_model")
        base = self.models.get(name)
        if base is None:
            raise TinkerRefusal(
                400,
                f"base_model {_shown(name)} is not served here; get_server_capabilities lists {sorted(self.models)}",
            )
        return base


def _shown(value: object) -> str:
    return repr(value)[:120]


def session_job(base: BaseModel, spec: SessionSpec, model_id: str) -> JobRequest:
    """The session job of a training model: the tenant's, on the base model's nodes, moved (not lost) if its node
    dies."""
    job = JobRequest(
        model=base.name,
        base_dir=base.base_dir,
        accelerator=base.accelerator,  # type: ignore[arg-type]
        session=spec,
        retries=3,  # a node that dies moves the session to another, from its last saved state
        label=f"tinker {model_id}",
        idempotency_key=f"tinker {model_id}",  # a create_model sent again is the same job, not a second one
    )
    job.train.method = "session"
    return job


def checked(values: dict, kind: type[T], where: str) -> T:
    """values as `kind`, its constraints checked and its numbers finite, or a 400 naming the field."""
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise TinkerRefusal(400, f"{where}.{name} is {value}: give a finite number")
    try:
        return msgspec.convert(values, kind)
    except msgspec.ValidationError as e:
        raise TinkerRefusal(400, f"{where}: {e}") from None
