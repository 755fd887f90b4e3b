"""The Tinker API's training calls: create_model (a session job of the key's tenant), forward_backward (and forward),
optim_step, save_weights, save_weights_for_sampler, load_weights (and a new model from a saved state). Each is
stored and answered at once with a request id; it runs in the model's order (order.py) and its outcome is fetched
with retrieve_future. A call's seq_id is its turn: once the model and the seq_id are read, anything wrong with the
rest of the call (or a fault of the gateway's own) still takes that turn, so the calls after it run."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from schemas.sessions import (
    SAVED_NAME,
    ForwardBackward,
    LoadWeights,
    OptimStep,
    SaveWeights,
    SessionCall,
    SessionSpec,
    SessionStart,
)
from schemas.tinker_store import (
    FutureRecord,
    ModelRecord,
    SessionRecord,
    model_key,
    ordered_request,
    session_key,
    stored_name,
)
from services.gateway.tinker import loss_calls, proto
from services.gateway.tinker.common import PREFIX, Ctx, checked, session_job
from services.gateway.tinker.exports import age_recipients
from services.gateway.tinker.futures import failed
from services.gateway.tinker.http import TinkerRefusal, body, field, logged_fault, reply, user_metadata
from services.gateway.tinker.paths import parse_path, tinker_path
from services.gateway.tinker.settings import limit

ADAM = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
TTL_RANGE = (3600, 10 * 365 * 86400)  # Tinker's: an hour to ten years
Built = tuple[str, SessionCall | None, dict[str, Any]]  # kind, call, args (outcomes.py)
Admit = Callable[[ModelRecord, str, Built], Awaitable[None]]  # a bound the call takes a place of (its request id)


class Training:
    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(PREFIX + "/create_model", self.create_model),
            web.post(PREFIX + "/forward_backward", self.forward_backward),
            web.post(PREFIX + "/optim_step", self.optim_step),
            web.post(PREFIX + "/save_weights", self.save_weights),
            web.post(PREFIX + "/save_weights_for_sampler", self.save_for_sampler),
            web.post(PREFIX + "/save_weights_external", self.save_external),
            web.post(PREFIX + "/load_weights", self.load_weights),
        ]

    # --- a call in its model's order ------------------------------------------------------------------------------
    async def _ordered(
        self,
        request: web.Request,
        tenant: str,
        model_id: object,
        seq: object,
        build: Callable[[ModelRecord], Built],
        admit: Admit | None = None,
    ) -> web.Response:
        ctx = self.ctx
        if not isinstance(model_id, str):
            raise TinkerRefusal(400, "model_id is missing: give the training model's id")
        model = await ctx.model(tenant, model_id)
        if model.kind != "train":
            raise TinkerRefusal(400, f"model_id {model.id} is a base model's sampler: it takes no training calls")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
            raise TinkerRefusal(400, f"seq_id {str(seq)[:40]!r}: give the call's turn, a whole number from 1")
        if seq < model.next_seq:
            taken = await ctx.book.find(tenant, ordered_request(model.id, seq))
            if taken is not None:  # the same call sent again: the same request id
                return reply({"request_id": taken.id, "model_id": model.id})
            raise TinkerRefusal(400, f"seq_id {seq} of {model.id} was taken already; the next is {model.next_seq}")
        window = ctx.settings.seq_window
        if seq > model.next_seq + window and ctx.order.model(model.id) is None:
            model = await ctx.model(tenant, model.id)  # the store's, fresher than this gateway's read
        if seq > model.next_seq + window:
            raise TinkerRefusal(
                400,
                f"seq_id {seq} is more than {window} ahead of model {model.id}'s next call ({model.next_seq}), the "
                "most a client may send ahead: send calls in order, and fetch results before sending far ahead",
            )
        if refusal := limit(ctx.book.pending.get(tenant, 0), ctx.settings.max_pending, "calls not done yet",
                            "max_pending", "fetch the results of earlier calls (future.result()) before sending more"):  # fmt: skip
            if (taken := await ctx.book.find(tenant, ordered_request(model.id, seq))) is not None:
                return reply({"request_id": taken.id, "model_id": model.id})  # sent again: no new call
            raise TinkerRefusal(400, refusal)
        try:
            kind, call, args = built = build(model)
            if admit is not None:
                await admit(model, ordered_request(model.id, seq), built)
        except TinkerRefusal as e:  # refused as sent: its turn is taken as nothing, so the calls after it run
            await self._consume(model, seq, e.detail)
            raise
        except Exception:
            fault = logged_fault(request)
            await self._consume(model, seq, f"the gateway failed on this call; request {fault.ident}", "server")
            raise fault from None
        request_id = ordered_request(model.id, seq)  # also its call id: one seq_id never runs twice on a node
        future = FutureRecord(id=request_id, tenant=tenant, model=model.id, seq=seq, kind=kind, call=call, args=args,
                              call_id=request_id, created=time.time())  # fmt: skip
        if ctx.order.model(model.id) is None:
            await ctx.book.record(future)  # stored, then taken by the gateway that runs the model's calls
            await ctx.order.arrived(future)
        else:  # it runs here: it starts while it is stored; the client hears of it once it is
            storing = asyncio.ensure_future(ctx.book.record(future))
            await ctx.order.arrived(future)
            await storing
        return reply({"request_id": request_id, "model_id": model.id})

    async def _consume(self, model: ModelRecord, seq: int, message: str, category: str = "user") -> None:
        refused = FutureRecord(id=ordered_request(model.id, seq), tenant=model.tenant, model=model.id, seq=seq,
                               kind="refused", created=time.time(), outcome=failed(message, category))  # fmt: skip
        if (stored := await self.ctx.book.record(refused)) is not None:
            await self.ctx.order.arrived(stored)

    # --- creating a model -----------------------------------------------------------------------------------------
    async def create_model(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        tenant, data = await ctx.tenant(request), await body(request)
        session, _ = await ctx.session(tenant, field(data, "session_id"))
        base = ctx.base(data)
        lora, optimizer = field(data, "lora_config", dict, {}), field(data, "optimizer_config", dict, {})
        if optimizer.get("type", "adamw") != "adamw":
            raise TinkerRefusal(400, f"optimizer_config.type {str(optimizer.get('type'))[:40]!r}: only adamw is served")
        settings = {k: lora[k] for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed") if k in lora}
        spec = checked({"train_unembed": True, **settings, "idle_s": ctx.settings.idle_s}, SessionSpec, "lora_config")
        if not spec.target_modules():
            raise TinkerRefusal(400, "lora_config: train_attn, train_mlp and train_unembed are all false; set one")
        seq = self._model_seq(data, session)
        model_id = f"{session.id}:train:{seq}"
        job, metadata = session_job(base, spec, model_id), user_metadata(data)
        return await self._new_model(tenant, session, model_id, base.name, spec, "create", job, {}, metadata)

    def _model_seq(self, data: dict, session: SessionRecord) -> int:
        seq = field(data, "model_seq_id", int, session.model_seq)
        if not 0 <= seq < 1_000_000:
            raise TinkerRefusal(400, f"model_seq_id {seq}: give 0 or more (the client counts its models from 0)")
        return seq

    async def _new_model(self, tenant: str, session: SessionRecord, model_id: str, base_model: str, spec: SessionSpec,
                         kind: str, job, args: dict, metadata: dict[str, str] | None) -> web.Response:  # fmt: skip
        """A model's place in the tenant's bound, its create (the model's first call, seq 0), its record (its calls
        run here) and its place in the session, each written only if it is not there yet and in that order: a
        create sent again (the client retries what failed or timed out) finds the same request id and finishes what
        the first try left undone; none is a model nobody can fetch the create of, or one outside the bound."""
        ctx = self.ctx
        first = ordered_request(model_id, 0)
        if await ctx.store.get(ctx.store.kv, model_key(tenant, model_id), ModelRecord) is not None:
            return reply({"request_id": first})  # a create sent again, all of it written: the same model
        await ctx.bounds.model(tenant, session.id, model_id)
        now = time.time()
        create = FutureRecord(id=first, tenant=tenant, model=model_id, seq=0, kind=kind, job=job, args=args,
                              call_id=first, created=now)  # fmt: skip
        stored = await ctx.book.record(create) or await ctx.book.find(tenant, first) or create
        record = ModelRecord(id=model_id, tenant=tenant, session=session.id, base_model=base_model, spec=spec,
                             pump=ctx.gateway, created=now, last_request=now, user_metadata=metadata)  # fmt: skip
        revision = await ctx.store.create(ctx.store.kv, model_key(tenant, model_id), record)
        await self._add_to_session(tenant, session.id, model_id, int(model_id.rsplit(":", 1)[1]))
        if revision is not None:
            ctx.order.start_new(record, revision, stored)
        return reply({"request_id": first})

    async def _add_to_session(self, tenant: str, session_id: str, model_id: str, seq: int) -> None:
        def add(s: SessionRecord) -> bool:
            if model_id in s.models:
                return False
            s.models.append(model_id)
            s.model_seq = max(s.model_seq, seq + 1)
            return True

        written = await self.ctx.store.modify(self.ctx.store.kv, session_key(tenant, session_id), SessionRecord, add)
        if written is None:
            raise TinkerRefusal(404, f"session {session_id} has ended")

    async def _create_from_state(self, tenant: str, data: dict) -> web.Response:
        ctx = self.ctx
        session, _ = await ctx.session(tenant, field(data, "session_id"))
        path = field(data, "path")
        owner, kind, name = parse_path(path)
        source = await ctx.model(tenant, owner, "path")
        save = source.saves.get(name)
        if kind != "weights" or save is None or source.spec is None or _expired(save):
            raise TinkerRefusal(404, f"path {path[:200]!r}: no state of yours by that name (save_state makes one)")
        if source.base_model not in ctx.models:
            raise TinkerRefusal(400, f"path: its base model {source.base_model!r} is no longer served here")
        optimizer = field(data, "optimizer", bool, False)
        start = SessionStart(job=source.job, name=name, step=save.step, optimizer=optimizer)
        spec = msgspec.structs.replace(source.spec, start_from=start)
        seq = self._model_seq(data, session)
        model_id = f"{session.id}:train:{seq}"
        job = session_job(ctx.models[source.base_model], spec, model_id)
        args, metadata = {"source_job": source.job, "step": save.step, "path": path}, user_metadata(data)
        return await self._new_model(tenant, session, model_id, source.base_model, spec, "create_from_state", job, args,
                                     metadata)  # fmt: skip

    # --- the calls ------------------------------------------------------------------------------------------------
    async def forward_backward(self, request: web.Request) -> web.Response:
        tenant = await self.ctx.tenant(request)
        try:
            message = proto.forward_backward(await request.read())
        except proto.ProtoRefused as e:
            raise TinkerRefusal(400, f"{e} ({e.field})") from None

        def build(model: ModelRecord) -> Built:
            return "forward", loss_calls.call(message), {}

        async def admit(model: ModelRecord, request_id: str, built: Built) -> None:
            assert isinstance(built[1], ForwardBackward)
            await loss_calls.complete(self.ctx.book, tenant, built[1], message)  # stable_reinforce's recorded inputs

        return await self._ordered(request, tenant, message.model_id, message.seq_id, build, admit)

    async def optim_step(self, request: web.Request) -> web.Response:
        tenant, data = await self.ctx.tenant(request), await body(request)

        def build(model: ModelRecord) -> Built:
            adam = field(data, "adam_params", dict, {})
            unknown = sorted(str(k)[:40] for k in set(adam) - set(ADAM))
            if unknown or "optimizer_params" in data:
                raise TinkerRefusal(400, f"adam_params {unknown or 'optimizer_params'}: only AdamParams are served")
            return "optim", checked(adam, OptimStep, "adam_params"), {}

        return await self._ordered(request, tenant, data.get("model_id"), data.get("seq_id"), build)

    async def save_weights(self, request: web.Request) -> web.Response:
        tenant, data = await self.ctx.tenant(request), await body(request)

        def build(model: ModelRecord) -> Built:
            return "save_state", _save(field(data, "path"), "state"), {"expires": _expires(data)}

        return await self._ordered(request, tenant, data.get("model_id"), data.get("seq_id"), build)

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        tenant, data = await self.ctx.tenant(request), await body(request)

        def build(model: ModelRecord) -> Built:
            named = data.get("path")
            name = named if named is not None else f"snapshot-{field(data, 'sampling_session_seq_id', int)}"
            call = msgspec.structs.replace(_save(name, "sampler"), stored=named is not None)
            return "save_sampler", call, {"named": named is not None, "expires": _expires(data)}

        async def admit(model: ModelRecord, request_id: str, built: Built) -> None:
            _, call, args = built
            if args["named"]:  # kept in the object store until deleted: a place in the tenant's bound first
                assert isinstance(call, SaveWeights)
                path = tinker_path(model.id, "sampler_weights", call.name)
                await self.ctx.bounds.sampler_save(tenant, model.session, path, request_id, args["expires"])

        return await self._ordered(request, tenant, data.get("model_id"), data.get("seq_id"), build, admit)

    async def save_external(self, request: web.Request) -> web.Response:
        """save_weights_external: the adapter's PEFT files, stored as a named sampler save is (exports.py serves
        them), counted with the tenant's named sampler saves."""
        tenant, data = await self.ctx.tenant(request), await body(request)

        def build(model: ModelRecord) -> Built:
            age = age_recipients(data.get("age_encryption_recipients"))
            name = _save(field(data, "path"), "sampler").name
            call = SaveWeights(name=stored_name("external_weights", name), kind="sampler", stored=True)
            path = tinker_path(model.id, "external_weights", name)
            return "save_external", call, {"path": path, "expires": _expires(data), "age": age}

        async def admit(model: ModelRecord, request_id: str, built: Built) -> None:
            args = built[2]
            await self.ctx.bounds.sampler_save(tenant, model.session, args["path"], request_id, args["expires"])

        return await self._ordered(request, tenant, data.get("model_id"), data.get("seq_id"), build, admit)

    async def load_weights(self, request: web.Request) -> web.Response:
        tenant, data = await self.ctx.tenant(request), await body(request)
        if "model_id" not in data:  # create_training_client_from_state: a new model from a saved state
            return await self._create_from_state(tenant, data)

        def build(model: ModelRecord) -> Built:
            path = field(data, "path")
            owner, kind, name = parse_path(path)
            save = model.saves.get(name)
            if owner != model.id or kind != "weights" or save is None or _expired(save):
                raise TinkerRefusal(400, f"path: a model loads the states it saved (tinker://{model.id}/weights/NAME)")
            return "load", LoadWeights(name=name, optimizer=field(data, "optimizer", bool, False)), {"path": path}

        return await self._ordered(request, tenant, data.get("model_id"), data.get("seq_id"), build)


def _save(name: object, kind: str) -> SaveWeights:
    if not isinstance(name, str) or not re.fullmatch(SAVED_NAME, name):
        raise TinkerRefusal(400, f"path {str(name)[:200]!r}: a name of letters, digits, '.', '_' and '-' (up to 128)")
    return SaveWeights(name=name, kind=kind)  # type: ignore[arg-type]


def _expires(data: dict) -> float | None:
    """When a save the client gave ttl_seconds goes."""
    ttl = field(data, "ttl_seconds", int, None)
    if ttl is None:
        return None
    if not TTL_RANGE[0] <= ttl <= TTL_RANGE[1]:
        raise TinkerRefusal(400, f"ttl_seconds {ttl}: give {TTL_RANGE[0]} (an hour) to {TTL_RANGE[1]} (ten years)")
    return time.time() + ttl


def _expired(save) -> bool:
    return save.expires is not None and save.expires < time.time()
