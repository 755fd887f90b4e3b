"""The Tinker API's training and sampling calls: create_model (a session job of the key's tenant), forward_backward,
optim_step, save_weights, save_weights_for_sampler, load_weights, sampling sessions and asample. Each answers at
once with a request id; the work runs in the model's order and its result is fetched with retrieve_future."""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from schemas.jobs import JobRequest
from schemas.sessions import (
    CallError,
    ForwardResult,
    LoadedResult,
    LoadWeights,
    OptimStep,
    Sample,
    SampleResult,
    SavedResult,
    SaveWeights,
    SessionCall,
    BASE_WEIGHTS,
    SAVED_NAME,
    SessionSpec,
    SessionStart,
    StepResult,
)
from services.gateway.openai_map import BaseModel
from services.gateway.tinker import proto
from services.gateway.tinker.futures import CallFailed, Futures, Outcome
from services.gateway.tinker.http import TinkerRefusal, body, field, reply
from services.gateway.tinker.sessions import Model, Sampler, Session, Sessions

T = TypeVar("T")
PREFIX = "/api/v1"
SCHEME = "tinker://"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{model_id}/{kind}/{name}"


def parse_path(path: str, where: str = "path") -> tuple[str, str, str]:
    """(model id, kind, name) of tinker://<model>/<weights|sampler_weights>/<name>."""
    parts = path.removeprefix(SCHEME).split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not parts[2]:
        raise TinkerRefusal(400, f"{where} {path!r} is not tinker://<model>/weights|sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


def answered(reply_: Any, expected: type) -> Any:
    """The session's answer, or the call's failure as the client shows it."""
    if isinstance(reply_, CallError):
        raise CallFailed(reply_.message + (f" (field {reply_.field})" if reply_.field else ""))
    if not isinstance(reply_, expected):
        raise CallFailed(f"the session answered {type(reply_).__name__}, not {expected.__name__}", "server")
    return reply_


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
            web.post(PREFIX + "/create_sampling_session", self.create_sampler),
            web.get(PREFIX + "/samplers/{id}", self.get_sampler),
            web.post(PREFIX + "/asample", self.asample),
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

    def _session_and_base(self, tenant: str, data: dict) -> tuple[Session, BaseModel]:
        session = self._session(tenant, data)
        name = field(data, "base_model")
        base = self.models.get(name)
        if base is None:
            raise TinkerRefusal(
                400, f"base_model {name!r} is not served here; get_server_capabilities lists {sorted(self.models)}"
            )
        return session, base

    def _session(self, tenant: str, data: dict) -> Session:
        session = self.sessions.session(tenant, field(data, "session_id"))
        if session is None:
            raise TinkerRefusal(404, f"no session {data['session_id']!r} of yours: create_session first")
        return session

    async def create_model(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant_of(request), await body(request)
        session, base = self._session_and_base(tenant, data)
        lora, optimizer = field(data, "lora_config", dict, {}), field(data, "optimizer_config", dict, {})
        if optimizer.get("type", "adamw") != "adamw":
            raise TinkerRefusal(400, f"optimizer_config.type {optimizer.get('type')!r}: only adamw is served")
        settings = {k: lora[k] for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed") if k in lora}
        spec = checked({"train_unembed": True, **settings, "idle_s": self.idle_s}, SessionSpec, "lora_config")
        seq = field(data, "model_seq_id", int, session.models)
        session.models = max(session.models, seq + 1)
        job = session_job(base, spec, f"{session.id}:train:{seq}")

        async def created() -> Outcome:
            model = await self.sessions.create(session, seq, job, base.name, spec.rank)
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
        session = self._session(tenant, data)
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
            model = await self.sessions.create(session, seq, job, base.name, spec.rank)
            model.saves, model.spec = {}, spec
            return Outcome(json={"model_id": model.id, "path": path, "type": "load_weights"})

        return reply({"request_id": self.futures.start(tenant, created())})

    async def create_sampler(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant_of(request), await body(request)
        path = data.get("model_path")
        if path is None:
            return await self._base_sampler(tenant, data)
        owner, kind, name = parse_path(path, "model_path")
        model = self.sessions.model(tenant, owner)
        if model is None or kind != "sampler_weights" or name not in model.samplers:
            raise TinkerRefusal(404, f"model_path {path!r}: no sampler weights of yours by that name")
        sampler_id = f"{owner}:sample:{name}"
        self.sessions.samplers[sampler_id] = Sampler(sampler_id, tenant, owner, name, model.base_model, path)
        return reply({"sampling_session_id": sampler_id})

    async def _base_sampler(self, tenant: str, data: dict) -> web.Response:
        """A sampling client of a base model alone: a session of its own, sampling with its adapter off (placed
        like any session; its first sample waits until it runs)."""
        session, base = self._session_and_base(tenant, data)
        seq = field(data, "sampling_session_seq_id", int, session.samplers)
        session.samplers = max(session.samplers, seq + 1)
        spec = SessionSpec(rank=1, train_mlp=False, idle_s=self.idle_s)  # an adapter it never uses
        model_id = f"{session.id}:base:{seq}"
        try:
            model = await self.sessions.submit_job(session, model_id, session_job(base, spec, model_id), base.name, 1)
        except CallFailed as e:
            raise TinkerRefusal(400, f"base_model {base.name!r}: {e}") from None
        sampler_id = f"{model.id}:sample"
        self.sessions.samplers[sampler_id] = Sampler(sampler_id, tenant, model.id, BASE_WEIGHTS, base.name, None)
        return reply({"sampling_session_id": sampler_id})

    async def get_sampler(self, request: web.Request) -> web.Response:
        tenant = await self.tenant_of(request)
        sampler = self.sessions.samplers.get(request.match_info["id"])
        if sampler is None or sampler.tenant != tenant:
            raise TinkerRefusal(404, f"no sampling session {request.match_info['id']!r} of yours")
        return reply({"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path})

    async def asample(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant_of(request), await body(request)
        sampler = self.sessions.samplers.get(field(data, "sampling_session_id"))
        model = self.sessions.model(tenant, sampler.model) if sampler and sampler.tenant == tenant else None
        if sampler is None or model is None:
            raise TinkerRefusal(404, f"no sampling session {data['sampling_session_id']!r} of yours")
        call = sample_call(data, sampler.weights)
        started = time.time()

        async def sampled() -> Outcome:
            result = answered(await self.sessions.send(model, call), SampleResult)
            return Outcome(body=proto.sample_output(result))

        request_id = self.futures.start(tenant, sampled())
        ids = [f"{request_id}-{i}-{int(started)}" for i in range(call.num_samples)]
        return reply({"request_id": request_id, "sample_sequence_ids": ids})


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


def sample_call(data: dict, weights: str | None) -> Sample:
    """A Sample call of an asample body, refusing what is not served, naming it."""
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k", "target_prompt_logprobs"):
        if data.get(name):
            raise TinkerRefusal(400, f"{name} is not served yet; leave it out")
    chunks = field(field(data, "prompt", dict), "chunks", list)
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type") != "encoded_text":
            raise TinkerRefusal(400, f"prompt.chunks[{i}]: only encoded_text chunks are served")
        tokens += [int(t) for t in chunk.get("tokens", [])]
    params = field(data, "sampling_params", dict, {})
    stop = params.get("stop")
    stop_strings = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
    stop_tokens = [s for s in stop or [] if isinstance(s, int)] if not isinstance(stop, str) else []
    settings = {
        k: params[k] for k in ("max_tokens", "temperature", "top_k", "top_p", "seed") if params.get(k) is not None
    }
    return checked(
        {**settings, "prompt": tokens, "num_samples": data.get("num_samples", 1), "stop_tokens": stop_tokens,
         "stop_strings": stop_strings, "weights": weights, "prompt_logprobs": bool(data.get("prompt_logprobs"))},
        Sample,
        "sampling_params",
    )  # fmt: skip


def checked(values: dict, kind: type[T], where: str) -> T:
    """values as `kind`, its constraints checked, or a 400 naming the field."""
    try:
        return msgspec.convert(values, kind)
    except msgspec.ValidationError as e:
        raise TinkerRefusal(400, f"{where}: {e}") from None
