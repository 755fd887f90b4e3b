"""The Tinker API's sampling: sampling sessions on a training model's saved sampler weights, a base model's own
sampling session (a session job of its own, sampling with its adapter off), and asample: stored, answered with a
request id at once, and run at once (samples need no order); its outcome is fetched with retrieve_future."""

from __future__ import annotations

import math
import secrets
import time

import msgspec
from aiohttp import web

from schemas.sessions import BASE_WEIGHTS, Sample, SessionSpec
from schemas.tinker_store import (
    FutureRecord,
    ModelRecord,
    SamplerRecord,
    SessionRecord,
    model_key,
    sampler_key,
    session_key,
)
from services.gateway.tinker.common import PREFIX, Ctx, checked, session_job
from services.gateway.tinker.futures import CallFailed
from services.gateway.tinker.http import TinkerRefusal, body, field, reply
from services.gateway.tinker.paths import parse_path
from services.gateway.tinker.provenance import sequence_id
from services.gateway.tinker.sampler_paths import resolve_sampler, target
from services.gateway.tinker.settings import limit

TOKEN_MAX = 2**31 - 1
SETTINGS = ("max_tokens", "temperature", "top_k", "top_p", "seed")


class Sampling:
    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(PREFIX + "/create_sampling_session", self.create_sampler),
            web.get(PREFIX + "/samplers/{id}", self.get_sampler),
            web.post(PREFIX + "/asample", self.asample),
        ]

    async def create_sampler(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        tenant, data = await ctx.tenant(request), await body(request)
        path = data.get("model_path")
        if path is None:
            return await self._base_sampler(tenant, data)
        found = await resolve_sampler(ctx, tenant, path, "model_path")  # a stored save, or one its session holds
        owner, _, name = parse_path(path, "model_path")
        sampler_id = f"{owner}:sample:{name}"
        sampler = SamplerRecord(id=sampler_id, tenant=tenant, model=owner, weights=name,
                                base_model=found.model.base_model, model_path=path, created=time.time(),
                                stored=found.stored)  # fmt: skip
        await ctx.store.put(ctx.store.kv, sampler_key(tenant, sampler_id), sampler)
        return reply({"sampling_session_id": sampler_id})

    async def _base_sampler(self, tenant: str, data: dict) -> web.Response:
        """A sampling client of a base model alone: a session of its own, sampling with its adapter off (placed
        like any session; its first sample waits until it runs)."""
        ctx = self.ctx
        session, _ = await ctx.session(tenant, field(data, "session_id"))
        base = ctx.base(data)
        seq = field(data, "sampling_session_seq_id", int, session.sampler_seq)
        if not 0 <= seq < 1_000_000:
            raise TinkerRefusal(400, f"sampling_session_seq_id {seq}: give 0 or more")
        model_id = f"{session.id}:base:{seq}"
        sampler_id = f"{model_id}:sample"
        if await ctx.store.get(ctx.store.kv, sampler_key(tenant, sampler_id), SamplerRecord) is not None:
            return reply({"sampling_session_id": sampler_id})  # sent again
        await ctx.bounds.model(tenant, session.id, model_id)
        spec = SessionSpec(rank=1, train_mlp=False, idle_s=ctx.settings.idle_s)  # an adapter it never uses
        try:
            job = await ctx.trainers.submit(tenant, session_job(base, spec, model_id))
        except CallFailed as e:
            raise TinkerRefusal(400, f"base_model {base.name!r}: {e}") from None
        now = time.time()
        record = ModelRecord(id=model_id, tenant=tenant, session=session.id, base_model=base.name, kind="base",
                             job=job, spec=spec, next_seq=1, created=now, last_request=now)  # fmt: skip
        await ctx.store.create(ctx.store.kv, model_key(tenant, model_id), record)

        def add(s: SessionRecord) -> bool:
            if model_id in s.models:
                return False
            s.models.append(model_id)
            s.sampler_seq = max(s.sampler_seq, seq + 1)
            return True

        await ctx.store.modify(ctx.store.kv, session_key(tenant, session.id), SessionRecord, add)
        sampler = SamplerRecord(id=sampler_id, tenant=tenant, model=model_id, weights=BASE_WEIGHTS,
                                base_model=base.name, model_path=None, created=now)  # fmt: skip
        await ctx.store.put(ctx.store.kv, sampler_key(tenant, sampler_id), sampler)
        return reply({"sampling_session_id": sampler_id})

    async def get_sampler(self, request: web.Request) -> web.Response:
        tenant = await self.ctx.tenant(request)
        sampler = await self.ctx.sampler(tenant, request.match_info["id"])
        return reply({"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path})

    async def asample(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        tenant, data = await ctx.tenant(request), await body(request)
        sampler = await ctx.sampler(tenant, field(data, "sampling_session_id"))
        found = await target(ctx, tenant, sampler.model, sampler.weights, sampler.stored, "sampling_session_id")
        call = msgspec.structs.replace(sample_call(data, found.weights, found.stored), object=found.object)
        recorded = {"stability": True} if data.get("record_stability_info") is True else {}  # for stable_reinforce
        future = await submit(ctx, found.model, call, recorded)
        ids = [sequence_id(future.id, i, int(future.created)) for i in range(call.num_samples)]
        return reply({"request_id": future.id, "sample_sequence_ids": ids})


async def submit(ctx: Ctx, model: ModelRecord, call: Sample, args: dict, kind: str = "sample") -> FutureRecord:
    """A sample of `model`'s, stored and run at once (within the tenant's max_pending); `kind` says what its outcome
    is (outcomes.py: Tinker's protobuf, or sample_text's JSON)."""
    tenant = model.tenant
    if refusal := limit(ctx.book.pending.get(tenant, 0), ctx.settings.max_pending, "calls not done yet",
                        "max_pending", "fetch the results of earlier samples before sending more"):  # fmt: skip
        raise TinkerRefusal(400, refusal)
    future = FutureRecord(id=f"{model.id}:s:{secrets.token_hex(8)}", tenant=tenant, model=model.id, seq=None,
                          kind=kind, call=call, args=args, call_id=secrets.token_hex(8), created=time.time(),
                          worker=ctx.gateway)  # fmt: skip
    stored = await ctx.book.record(future)
    if stored is None:
        raise TinkerRefusal(409, "that request id was just taken; send the sample again")
    ctx.order.at_once.run(stored, ctx.order.model(model.id) or model)
    return stored


def _number(value: object, where: str, whole: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        raise TinkerRefusal(400, f"{where} is {str(value)[:40]!r}: give a {'whole ' if whole else ''}number")
    if isinstance(value, float) and not math.isfinite(value):
        raise TinkerRefusal(400, f"{where} is {value}: give a finite number")
    return value


def _tokens(values: object, where: str) -> list[int]:
    if not isinstance(values, list):
        raise TinkerRefusal(400, f"{where}: give a list of token ids")
    for n, t in enumerate(values):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= TOKEN_MAX:
            raise TinkerRefusal(400, f"{where}[{n}] is {str(t)[:40]!r}: a token id is a whole number from 0")
    return values


def _stops(stop: object) -> tuple[list[int], list[str]]:
    """sampling_params.stop: a string, a list of strings, or a list of token ids."""
    if stop is None:
        return [], []
    if isinstance(stop, str):
        return [], [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [], list(stop)
    if isinstance(stop, list):
        return _tokens(stop, "sampling_params.stop"), []
    raise TinkerRefusal(400, f"sampling_params.stop is {str(stop)[:40]!r}: give a string, strings, or token ids")


def sample_call(data: dict, weights: str | None, stored: bool = False) -> Sample:
    """A Sample call of an asample body, refusing what is not served or malformed, naming it."""
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k", "target_prompt_logprobs"):
        if data.get(name):
            raise TinkerRefusal(400, f"{name} is not served yet; leave it out")
    chunks = field(field(data, "prompt", dict), "chunks", list)
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type") != "encoded_text":
            raise TinkerRefusal(400, f"prompt.chunks[{i}]: only encoded_text chunks are served")
        tokens += _tokens(chunk.get("tokens", []), f"prompt.chunks[{i}].tokens")
    params = field(data, "sampling_params", dict, {})
    stop_tokens, stop_strings = _stops(params.get("stop"))
    settings = {}
    for name in SETTINGS:
        if params.get(name) is not None:
            settings[name] = _number(
                params[name], f"sampling_params.{name}", whole=name in ("max_tokens", "top_k", "seed")
            )
    num = _number(data.get("num_samples", 1), "num_samples", whole=True)
    return checked(
        {**settings, "prompt": tokens, "num_samples": num, "stop_tokens": stop_tokens, "stop_strings": stop_strings,
         "weights": weights, "stored": stored, "prompt_logprobs": data.get("prompt_logprobs") is True},
        Sample,
        "sampling_params",
    )  # fmt: skip
