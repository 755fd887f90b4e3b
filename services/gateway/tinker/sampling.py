"""The Tinker API's sampling: sampling sessions on a training model's saved sampler weights (or its weights as they
are), a base model's own sampling session, and asample, whose result is fetched with retrieve_future."""

from __future__ import annotations

import time

from aiohttp import web

from schemas.sessions import BASE_WEIGHTS, Sample, SampleResult, SessionSpec
from services.gateway.openai_map import BaseModel
from services.gateway.tinker import proto
from services.gateway.tinker.common import answered, checked, parse_path, session_and_base, session_job
from services.gateway.tinker.futures import CallFailed, Futures, Outcome
from services.gateway.tinker.http import TinkerRefusal, body, field, reply
from services.gateway.tinker.sessions import Sampler, Sessions

PREFIX = "/api/v1"


class Sampling:
    def __init__(self, sessions: Sessions, futures: Futures, models: dict[str, BaseModel], idle_s: float) -> None:
        self.sessions, self.futures, self.models, self.idle_s = sessions, futures, models, idle_s

    def routes(self, tenant_of) -> list[web.RouteDef]:
        self.tenant_of = tenant_of
        return [
            web.post(PREFIX + "/create_sampling_session", self.create_sampler),
            web.get(PREFIX + "/samplers/{id}", self.get_sampler),
            web.post(PREFIX + "/asample", self.asample),
        ]

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
        session, base = session_and_base(self.sessions, self.models, tenant, data)
        seq = field(data, "sampling_session_seq_id", int, session.samplers)
        session.samplers = max(session.samplers, seq + 1)
        spec = SessionSpec(rank=1, train_mlp=False, idle_s=self.idle_s)  # an adapter it never uses
        model_id = f"{session.id}:base:{seq}"
        try:
            model = await self.sessions.submit_job(session, model_id, session_job(base, spec, model_id), base.name)
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
