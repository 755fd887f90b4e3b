"""What samples a sampler save of the caller's: a tinker://<run>/sampler_weights/<name> path, or a sampling
session made from one, resolved at each sample. A stored save (schemas/tinker_store.py SamplerSave) is sampled by
the session that saved it while that session lives, and once it has ended (finished, or its records deleted after
retention) by the tenant's serving sampler of its base and layout (serving.py), which fetches it on demand; an
unnamed snapshot lives only as long as its session. What is none of the caller's is a 404."""

from __future__ import annotations

import time
from dataclasses import dataclass

from schemas.tinker_store import ModelRecord, model_key
from services.gateway.tinker.common import Ctx
from services.gateway.tinker.http import TinkerRefusal
from services.gateway.tinker.paths import parse_path, tinker_path
from services.gateway.tinker.serving import Serving, local_name


@dataclass
class Target:
    """The model to send a sample to, and how its Sample names the weights there."""

    model: ModelRecord
    weights: str | None
    stored: bool
    object: str = ""  # a save of another job's: the object its node fetches


async def resolve_sampler(ctx: Ctx, tenant: str, path: object, where: str) -> Target:
    """What samples a sampler path now (404 for one that is none of the caller's, or is gone)."""
    owner, kind, name = parse_path(path, where)
    if kind != "sampler_weights":
        raise TinkerRefusal(404, f"{where} {str(path)[:200]!r}: not a sampler path (…/sampler_weights/<name>)")
    return await target(ctx, tenant, owner, name, stored=None, where=where)


async def target(ctx: Ctx, tenant: str, owner: str, weights: str | None, stored: bool | None, where: str) -> Target:
    """What samples `weights` of model `owner` now (stored None: whichever it is)."""
    path = tinker_path(owner, "sampler_weights", weights or "")
    save = await ctx.saves.find(tenant, path) if stored is not False and weights else None
    if save is not None:
        model = await _model(ctx, tenant, owner)
        if model is None or _ended(ctx, model):
            serving = await Serving(ctx.store, ctx.trainers, ctx.models, ctx.settings, ctx.bounds).model(save)
            return Target(serving, local_name(save), True, save.object)
        return Target(model, weights, True)
    if stored:
        raise TinkerRefusal(404, f"{where} {path[:200]!r}: no sampler weights of yours by that name (deleted, or "
                                 "its TTL passed)")  # fmt: skip
    model = await ctx.model(tenant, owner, where)
    snapshot = model.samplers.get(weights) if weights is not None else None
    if stored is None and (snapshot is None or (snapshot.expires is not None and snapshot.expires < time.time())):
        raise TinkerRefusal(404, f"{where} {path[:200]!r}: no sampler weights of yours by that name")
    return Target(model, weights, False)


async def _model(ctx: Ctx, tenant: str, model_id: str) -> ModelRecord | None:
    model = ctx.order.model(model_id)
    if model is None:
        found = await ctx.store.get(ctx.store.kv, model_key(tenant, model_id), ModelRecord)
        model = found[0] if found is not None else None
    return model if model is not None and model.tenant == tenant else None


def _ended(ctx: Ctx, model: ModelRecord) -> bool:
    """Its client session has finished (its jobs stopped), or is gone."""
    found = ctx.mirror.session(model.tenant, model.session)
    return found is None or found[0].finished is not None
