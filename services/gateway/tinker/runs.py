"""The Tinker API's RestClient routes: a tenant's training runs (list_training_runs, get_training_run), its sessions
(list_sessions, get_session), and a run's checkpoints (its saves in its record, its named sampler saves in their own:
saves.py): listed, deleted, or given a time to live."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from schemas.sessions import Forget
from schemas.tinker_store import (
    ModelRecord,
    SamplerRecord,
    SamplerSave,
    SaveRecord,
    model_key,
    sampler_key,
    stored_name,
    token,
)
from services.gateway.tinker.common import PREFIX, Ctx
from services.gateway.tinker.http import TinkerRefusal, body, reply
from services.gateway.tinker.paths import KINDS, parse_path, tinker_path
from services.gateway.tinker.training import TTL_RANGE

PAGE_MAX = 1000


def iso(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


def checkpoints(model: ModelRecord, named: list[SamplerSave]) -> list[dict]:
    """Its saves (training) and sampler saves (unnamed ones in its record, `named` in their own), oldest first;
    those past their TTL are gone."""
    now, out = time.time(), []
    stored: dict[str, dict[str, SaveRecord]] = {"sampler_weights": {}, "external_weights": {}}
    for s in named:  # named sampler saves, and exports (save_weights_external)
        _, kind, name = parse_path(s.path)
        stored[kind][name] = SaveRecord(step=s.step, time=s.time, expires=s.expires)
    for kind, saves in (("weights", model.saves), ("sampler_weights", {**model.samplers, **stored["sampler_weights"]}),
                        ("external_weights", stored["external_weights"])):  # fmt: skip
        for name, save in saves.items():
            if save.expires is None or save.expires > now:
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{name}",
                        "checkpoint_type": KINDS[kind],
                        "time": iso(save.time),
                        "tinker_path": tinker_path(model.id, kind, name),
                        "expires_at": None if save.expires is None else iso(save.expires),
                    }
                )
    return sorted(out, key=lambda c: c["time"])


def training_run(model: ModelRecord, named: list[SamplerSave]) -> dict:
    listed = checkpoints(model, named)
    return {
        "training_run_id": model.id,
        "base_model": model.base_model,
        "model_owner": model.tenant,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": model.spec.rank if model.spec else None,
        "last_request_time": iso(model.last_request or model.created),
        "last_checkpoint": next((c for c in reversed(listed) if c["checkpoint_type"] == "training"), None),
        "last_sampler_checkpoint": next((c for c in reversed(listed) if c["checkpoint_type"] == "sampler"), None),
        "user_metadata": model.user_metadata,
    }


def page(request: web.Request) -> tuple[int, int]:
    values = []
    for name, default in (("limit", 20), ("offset", 0)):
        raw = request.query.get(name, str(default))
        if not raw.isdigit() or (name == "limit" and not 1 <= int(raw) <= PAGE_MAX):
            raise TinkerRefusal(400, f"{name} {raw[:20]!r}: give a whole number (limit 1 to {PAGE_MAX})")
        values.append(int(raw))
    return values[0], values[1]


class Runs:
    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx

    def routes(self) -> list[web.RouteDef]:
        run = PREFIX + "/training_runs/{id}"
        return [
            web.get(PREFIX + "/training_runs", self.list_runs),
            web.get(run, self.get_run),
            web.get(run + "/checkpoints", self.list_checkpoints),
            web.delete(run + "/checkpoints/{kind}/{name}", self.delete_checkpoint),
            web.put(run + "/checkpoints/{kind}/{name}/ttl", self.set_ttl),
            web.get(PREFIX + "/sessions", self.list_sessions),
            web.get(PREFIX + "/sessions/{id}", self.get_session),
        ]

    async def list_runs(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        tenant = await ctx.tenant(request)
        limit, offset = page(request)
        models = [m for m in await ctx.store.scan(ctx.store.kv, f"model.{tenant}.>", ModelRecord) if m.kind == "train"]
        models.sort(key=lambda m: (m.created, m.id))
        named: dict[str, list[SamplerSave]] = {}
        for save in await ctx.saves.of(tenant):
            named.setdefault(save.model, []).append(save)
        runs = [training_run(ctx.order.model(m.id) or m, named.get(m.id, [])) for m in models[offset : offset + limit]]
        return reply({"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": len(models)}})

    async def get_run(self, request: web.Request) -> web.Response:
        tenant = await self.ctx.tenant(request)
        model = await self.ctx.model(tenant, request.match_info["id"], "training run")
        return reply(training_run(model, await self.ctx.saves.of(tenant, model.id)))

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        tenant = await self.ctx.tenant(request)
        model = await self.ctx.model(tenant, request.match_info["id"], "training run")
        return reply({"checkpoints": checkpoints(model, await self.ctx.saves.of(tenant, model.id)), "cursor": None})

    async def _named(self, request: web.Request) -> tuple[ModelRecord, SamplerSave | None]:
        """The caller's run, and the named sampler save the path names (None: a save in the run's record)."""
        ctx = self.ctx
        tenant, kind, name = await ctx.tenant(request), request.match_info["kind"], request.match_info["name"]
        model = await ctx.model(tenant, request.match_info["id"], "training run")
        if kind not in KINDS:
            raise TinkerRefusal(400, f"checkpoint {kind}/{name[:100]}: its kind is weights or sampler_weights")
        if kind == "weights":
            return model, None
        return model, await ctx.saves.find(tenant, tinker_path(model.id, kind, name))

    async def _change_save(
        self, request: web.Request, change: Callable[[dict[str, SaveRecord], str], bool]
    ) -> ModelRecord:
        """Change one save of the caller's run (404 if there is none by that name), in the store and in the copy of
        the gateway that runs the model's calls, if it is this one."""
        ctx = self.ctx
        tenant, kind, name = await ctx.tenant(request), request.match_info["kind"], request.match_info["name"]
        model = await ctx.model(tenant, request.match_info["id"], "training run")
        if name not in (model.saves if kind == "weights" else model.samplers):
            raise TinkerRefusal(404, f"no checkpoint {kind}/{name[:100]} in training run {model.id}")

        def apply(m: ModelRecord) -> bool:
            return change(m.saves if kind == "weights" else m.samplers, name)

        if not ctx.order.change(model.id, apply):
            if await ctx.store.modify(ctx.store.kv, model_key(tenant, model.id), ModelRecord, apply) is None:
                raise TinkerRefusal(404, f"no training run {model.id} of yours")
        return model

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        kind, name = request.match_info["kind"], request.match_info["name"]
        model, named = await self._named(request)
        if named is not None:  # its record, its object and its place in the tenant's bound
            await self.ctx.saves.delete(named)
        else:
            model = await self._change_save(request, lambda saves, n: saves.pop(n, None) is not None)
        if kind == "sampler_weights":
            await self.ctx.store.delete(self.ctx.store.kv, sampler_key(model.tenant, f"{model.id}:sample:{name}"))
        if await self.ctx.trainers.running_on(model):  # its files go too (a paused one keeps them until it ends)
            call = Forget(name=stored_name(kind, name), kind="state" if kind == "weights" else "sampler")
            await self.ctx.trainers.send(model, call, "")
        return web.Response(status=204)

    async def set_ttl(self, request: web.Request) -> web.Response:
        data = await body(request)
        ttl = data.get("ttl_seconds")
        if ttl is not None and (
            isinstance(ttl, bool) or not isinstance(ttl, int) or not TTL_RANGE[0] <= ttl <= TTL_RANGE[1]
        ):
            raise TinkerRefusal(400, f"ttl_seconds {str(ttl)[:20]!r}: give {TTL_RANGE[0]} to {TTL_RANGE[1]}, or null")
        expires = None if ttl is None else time.time() + ttl

        def set_expiry(saves: dict[str, SaveRecord], name: str) -> bool:
            if name not in saves:
                return False
            saves[name].expires = expires
            return True

        _, named = await self._named(request)
        if named is not None:
            await self.ctx.saves.expire(named, expires)
        else:
            await self._change_save(request, set_expiry)
        return web.Response(status=204)

    async def list_sessions(self, request: web.Request) -> web.Response:
        tenant = await self.ctx.tenant(request)
        limit, offset = page(request)
        sessions = sorted(
            (s for s, _ in self.ctx.mirror.sessions.values() if s.tenant == tenant), key=lambda s: s.created
        )
        return reply({"sessions": [s.id for s in sessions[offset : offset + limit]]})

    async def get_session(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        tenant = await ctx.tenant(request)
        session, _ = await ctx.session(tenant, request.match_info["id"], "the path's session id")
        samplers = await ctx.store.scan(ctx.store.kv, f"sampler.{tenant}.{token(session.id)}.>", SamplerRecord)
        runs = [m for m in session.models if ":train:" in m]
        return reply(
            {
                "training_run_ids": runs,
                "sampler_ids": [s.id for s in sorted(samplers, key=lambda s: s.created)],
                "user_metadata": session.user_metadata,
            }
        )
