"""The Tinker API's training calls: create_model (a session job of the key's tenant), forward_backward, optim_step,
save_weights, save_weights_for_sampler, load_weights (and a new model from a saved state). Each answers at once with
a request id; the work runs in the model's order and its result is fetched with retrieve_future."""

from __future__ import annotations

import contextlib
import re
import msgspec
from aiohttp import web

from schemas.sessions import (
    ForwardResult,
    LoadedResult,
    LoadWeights,
    OptimStep,
    SavedResult,
    SaveWeights,
    SessionCall,
    SAVED_NAME,
    SessionSpec,
    SessionStart,
    StepResult,
)
from services.gateway.openai_map import BaseModel
from services.gateway.tinker import proto
from services.gateway.tinker.common import (
    answered,
    checked,
    parse_path,
    session_and_base,
    session_job,
    session_of,
    tinker_path,
)
from services.gateway.tinker.futures import Futures, Outcome
from services.gateway.tinker.http import TinkerRefusal, body, field, reply
from services.gateway.tinker.sessions import Model, Sampler, Sessions

PREFIX = "/api/v1"


class Training:
    def __init__(self, sessions: Sessions, futures: Futures, models: dict[str, BaseModel], idle_s: float) -> None:
        self.sessions, self.futures, self.models, self.idle_s = sessions, futures, models, idle_s

    def routes(self, tenant_of) -> list[web.RouteDef]:
        self.tenant_of = tenant_of
        return [
            web.post(PREFIX + "/create_model", self.create_model),
            web.post(PREFIX + "/forward_backward", self.forward_backward),
            web.post(PREFIX + "/optim_step", self.optim_step),
            web.post(PREFIX + "/save_weights", self.save_weights),
            web.post(PREFIX + "/save_weights_for_sampler", self.save_for_sampler),
            web.post(PREFIX + "/load_weights", self.load_weights),
        ]

    def _model(self, tenant: str, data: dict) -> Model:
        model = self.sessions.model(tenant, field(data, "model_id"))
        if model is None:
            raise TinkerRefusal(404, f"no training model {data['model_id']!r} of yours")
        return model

    @contextlib.contextmanager
    def _skipped_if_refused(self, model: Model, seq: int):
        """A call refused at the door still takes its turn (as nothing), so the model's later calls run."""
        try:
            yield
        except TinkerRefusal:
            if seq >= model.next_seq and seq not in model.waiting and seq not in model.requests:
                self.sessions.submit(model, seq, None)
            raise

    def _ordered(self, tenant: str, model: Model, seq: int, call: SessionCall, done) -> web.Response:
        """The call in the model's order (a re-sent seq_id gets its first request id)."""
        if seq in model.requests:
            return reply({"request_id": model.requests[seq]})
        if seq < model.next_seq:
            raise TinkerRefusal(400, f"seq_id {seq} of {model.id} was taken already; the next is {model.next_seq}")
        waiter = self.sessions.submit(model, seq, call)

        async def result() -> Outcome:
            return done(await waiter)

        model.requests[seq] = self.futures.start(tenant, result())
        return reply({"request_id": model.requests[seq], "model_id": model.id})

    async def create_model(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant_of(request), await body(request)
        session, base = session_and_base(self.sessions, self.models, tenant, data)
        lora, optimizer = field(data, "lora_config", dict, {}), field(data, "optimizer_config", dict, {})
        if optimizer.get("type", "adamw") != "adamw":
            raise TinkerRefusal(400, f"optimizer_config.type {optimizer.get('type')!r}: only adamw is served")
        settings = {k: lora[k] for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed") if k in lora}
        spec = checked({"train_unembed": True, **settings, "idle_s": self.idle_s}, SessionSpec, "lora_config")
        seq = field(data, "model_seq_id", int, session.models)
        session.models = max(session.models, seq + 1)
        job = session_job(base, spec, f"{session.id}:train:{seq}")

        async def created() -> Outcome:
            model = await self.sessions.create(session, seq, job, base.name)
            return Outcome(json={"model_id": model.id, "type": "create_model"})

        return reply({"request_id": self.futures.start(tenant, created())})

    async def forward_backward(self, request: web.Request) -> web.Response:
        tenant = await self.tenant_of(request)
        try:
            message = proto.forward_backward(await request.read())
        except proto.ProtoRefused as e:
            raise TinkerRefusal(400, f"{e} ({e.field})") from None
        model, seq = self._model(tenant, {"model_id": message.model_id}), message.seq_id
        with self._skipped_if_refused(model, seq):
            try:
                call = proto.call_of(message)
            except proto.ProtoRefused as e:
                raise TinkerRefusal(400, f"{e} ({e.field})") from None
        return self._ordered(
            tenant, model, seq, call, lambda r: Outcome(body=proto.forward_output(answered(r, ForwardResult)))
        )

    async def optim_step(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant_of(request), await body(request)
        model, seq = self._model(tenant, data), field(data, "seq_id", int)
        with self._skipped_if_refused(model, seq):
            adam = field(data, "adam_params", dict, {})
            unknown = sorted(set(adam) - {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"})
            if unknown or "optimizer_params" in data:
                raise TinkerRefusal(400, f"adam_params {unknown or 'optimizer_params'}: only AdamParams are served")
            call = checked(adam, OptimStep, "adam_params")

        def done(r) -> Outcome:
            step = answered(r, StepResult)
            metrics = {"step": float(step.step)} | ({} if step.grad_norm is None else {"grad_norm": step.grad_norm})
            return Outcome(json={"metrics": metrics})

        return self._ordered(tenant, model, seq, call, done)

    async def save_weights(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant_of(request), await body(request)
        model, seq = self._model(tenant, data), field(data, "seq_id", int)
        with self._skipped_if_refused(model, seq):
            call = self._save(field(data, "path"), "state")
        return self._ordered(
            tenant,
            model,
            seq,
            call,
            lambda r: Outcome(
                json={"path": tinker_path(model.id, "weights", self._saved(model, answered(r, SavedResult)))}
            ),
        )

    @staticmethod
    def _saved(model: Model, saved: SavedResult) -> str:
        model.saves[saved.name] = saved.step
        return saved.name

    @staticmethod
    def _save(name: str, kind: str) -> SaveWeights:
        if not isinstance(name, str) or not re.fullmatch(SAVED_NAME, name):
            raise TinkerRefusal(400, f"path {name!r}: a name of letters, digits, '.', '_' and '-' (up to 128)")
        return SaveWeights(name=name, kind=kind)  # type: ignore[arg-type]

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant_of(request), await body(request)
        model = self._model(tenant, data)
        named = data.get("path")
        name = named if named is not None else f"snapshot-{field(data, 'sampling_session_seq_id', int)}"
        sampler_id = f"{model.id}:sample:{name}"

        def done(r) -> Outcome:
            saved = answered(r, SavedResult)
            model.samplers.add(saved.name)
            path = tinker_path(model.id, "sampler_weights", saved.name)
            self.sessions.samplers[sampler_id] = Sampler(
                sampler_id, tenant, model.id, saved.name, model.base_model, path
            )
            return Outcome(
                json={"path": path} if named is not None else {"path": path, "sampling_session_id": sampler_id}
            )

        seq = field(data, "seq_id", int)
        with self._skipped_if_refused(model, seq):
            call = self._save(name, "sampler")
        return self._ordered(tenant, model, seq, call, done)

    async def load_weights(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant_of(request), await body(request)
        if "model_id" not in data:  # create_training_client_from_state: a new model from a saved state
            return await self._create_from_state(tenant, data)
        model, seq = self._model(tenant, data), field(data, "seq_id", int)
        with self._skipped_if_refused(model, seq):
            owner, kind, name = parse_path(field(data, "path"))
            if owner != model.id or kind != "weights":
                raise TinkerRefusal(400, f"path: a model loads the states it saved (tinker://{model.id}/weights/NAME)")
            call = LoadWeights(name=name, optimizer=bool(data.get("optimizer", False)))

        def done(r) -> Outcome:
            loaded = answered(r, LoadedResult)
            return Outcome(json={"path": data["path"], "model_id": model.id, "step": loaded.step})

        return self._ordered(tenant, model, seq, call, done)

    async def _create_from_state(self, tenant: str, data: dict) -> web.Response:
        session = session_of(self.sessions, tenant, data)
        path = field(data, "path")
        owner, kind, name = parse_path(path)
        source = self.sessions.model(tenant, owner)
        if source is None or kind != "weights" or name not in source.saves or source.spec is None:
            raise TinkerRefusal(404, f"path {path!r}: no state of yours by that name (save_state makes one)")
        base = self.models[source.base_model]
        optimizer = bool(data.get("optimizer", False))
        start = SessionStart(job=source.job, name=name, step=source.saves[name], optimizer=optimizer)
        spec = msgspec.structs.replace(source.spec, start_from=start)
        seq = field(data, "model_seq_id", int, session.models)
        session.models = max(session.models, seq + 1)
        job = session_job(base, spec, f"{session.id}:train:{seq}")

        async def created() -> Outcome:
            await self.sessions.stored(source, start.step)
            model = await self.sessions.create(session, seq, job, base.name)
            model.saves, model.spec = {}, spec
            return Outcome(json={"model_id": model.id, "path": path, "type": "load_weights"})

        return reply({"request_id": self.futures.start(tenant, created())})
