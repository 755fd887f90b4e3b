"""The Tinker API under /api/v1/, beside the OpenAI routes and with the same per-tenant keys, so the official `tinker`
client drives jetlora step by step (TINKER_BASE_URL = the gateway, TINKER_API_KEY = tml-<a jetlora key>): the
client's handshake (client/config), sessions and their heartbeats, the fleet's base models, model info, futures
(retrieve_future, a long poll) and the end of a session; the training and sampling calls are training.py's."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from services.gateway.keys import KeyStore
from services.gateway.openai_map import BaseModel
from services.gateway.tinker import proto
from services.gateway.tinker.futures import Futures
from services.gateway.tinker.http import TinkerRefusal, body, field, refused, reply, tenant_of
from services.gateway.tinker.sessions import Sessions
from services.gateway.tinker.common import tinker_path
from services.gateway.tinker.sampling import Sampling
from services.gateway.tinker.training import PREFIX, Training

log = logging.getLogger(__name__)
REAP_S = 30.0
SILENT_S = 600.0  # a session with no heartbeat this long is ended (the client sends one every 10 s)
CHUNK_BYTES = 150_000  # a forward_backward request's protobuf at most: its JSON on the bus is a few times larger


class TinkerApi:
    def __init__(self, nc, keys: KeyStore, models: dict[str, BaseModel], idle_s: float = 900.0) -> None:
        self.nc, self.keys, self.models = nc, keys, models
        self.sessions, self.futures = Sessions(nc), Futures()
        self.training = Training(self.sessions, self.futures, models, idle_s)
        self.sampling = Sampling(self.sessions, self.futures, models, idle_s)

    async def tenant(self, request: web.Request) -> str:
        return await tenant_of(request, self.keys)

    def routes(self) -> list[web.RouteDef]:
        return (
            [
                web.post(PREFIX + "/client/config", self.client_config),
                web.post(PREFIX + "/client/dynamic_config", self.dynamic_config),
                web.post(PREFIX + "/create_session", self.create_session),
                web.post(PREFIX + "/session_heartbeat", self.heartbeat),
                web.post(PREFIX + "/telemetry", self.telemetry),
                web.get(PREFIX + "/get_server_capabilities", self.capabilities),
                web.post(PREFIX + "/get_info", self.get_info),
                web.post(PREFIX + "/retrieve_future", self.retrieve_future),
                web.post(PREFIX + "/sessions/{id}/finish", self.finish),
                web.get(PREFIX + "/training_runs/{id}/checkpoints", self.checkpoints),
            ]
            + self.training.routes(self.tenant)
            + self.sampling.routes(self.tenant)
        )

    @staticmethod
    @web.middleware
    async def refusals(request: web.Request, handler):
        """A refusal in the shape the client shows (and does not retry)."""
        try:
            return await handler(request)
        except TinkerRefusal as e:
            return refused(e)

    async def client_config(self, request: web.Request) -> web.Response:
        await self.tenant(request)  # a bad key is told at the client's first call
        chunk = min(CHUNK_BYTES, max(10_000, self.nc.max_payload // 6))
        return reply(
            {
                "pjwt_auth_enabled": False,
                "use_pyqwest_transport": False,
                "proto_compress_fwdbwd": False,
                "fwdbwd_max_chunk_bytes_count": chunk,
                "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False,
                "sample_join_sampling_session": False,
            }
        )

    async def dynamic_config(self, request: web.Request) -> web.Response:
        await self.tenant(request)
        return reply({})

    async def create_session(self, request: web.Request) -> web.Response:
        session = self.sessions.new_session(await self.tenant(request))
        return reply({"session_id": session.id})

    async def heartbeat(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant(request), await body(request)
        session = self.sessions.session(tenant, field(data, "session_id"))
        if session is None:
            raise TinkerRefusal(404, f"no session {data['session_id']!r} of yours")
        if session.finished:
            return reply({"detail": "the session has finished"}, 410)
        session.heard = time.monotonic()
        return reply({"type": "session_heartbeat"})

    async def telemetry(self, request: web.Request) -> web.Response:
        await self.tenant(request)
        return reply({"status": "accepted"})  # the client's own diagnostics: not kept

    async def capabilities(self, request: web.Request) -> web.Response:
        await self.tenant(request)
        models = [{"model_name": name, "trainable": True, "sampleable": True} for name in sorted(self.models)]
        return reply({"supported_models": models})

    async def get_info(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant(request), await body(request)
        model = self.sessions.model(tenant, field(data, "model_id"))
        if model is None or model.info is None:
            raise TinkerRefusal(404, f"no training model {data['model_id']!r} of yours")
        info = model.info
        return reply(
            {
                "type": "get_info",
                "model_id": model.id,
                "model_data": {"arch": info.arch, "model_name": model.base_model, "tokenizer_id": info.tokenizer_dir},
                "is_lora": True,
                "lora_rank": info.rank,
                "model_name": model.base_model,
                "optimizer_config": {"type": "adamw"},
            }
        )

    async def retrieve_future(self, request: web.Request) -> web.Response:
        tenant, data = await self.tenant(request), await body(request)
        request_id = field(data, "request_id")
        try:
            outcome = await self.futures.retrieve(tenant, request_id)
        except KeyError:
            raise TinkerRefusal(404, f"no request {request_id!r} of yours (or its result expired)") from None
        if outcome is None:  # not done yet: the client asks again at once, quietly
            return reply({"type": "try_again", "request_id": request_id, "queue_state": "active"}, 408)
        if outcome.body is not None:
            return web.Response(body=outcome.body, content_type=proto.CONTENT_TYPE)
        return reply(outcome.json)

    async def finish(self, request: web.Request) -> web.Response:
        tenant = await self.tenant(request)
        session = self.sessions.session(tenant, request.match_info["id"])
        if session is None:
            raise TinkerRefusal(404, f"no session {request.match_info['id']!r} of yours")
        session.finished = True
        for model in self.sessions.of(session):
            await self.sessions.end(model)  # each stores its adapter: the job's artifact, to register
        return reply({})

    async def checkpoints(self, request: web.Request) -> web.Response:
        tenant = await self.tenant(request)
        model = self.sessions.model(tenant, request.match_info["id"])
        if model is None:
            raise TinkerRefusal(404, f"no training run {request.match_info['id']!r} of yours")
        listed = [
            {
                "checkpoint_id": f"sampler_weights/{name}",
                "checkpoint_type": "sampler",
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "tinker_path": tinker_path(model.id, "sampler_weights", name),
            }
            for name in sorted(model.samplers)
        ]
        return reply({"checkpoints": listed, "cursor": None})

    async def reap(self) -> None:
        """Every REAP_S: a session whose client stopped heartbeating (killed, lost) ends as if it had finished
        (its jobs stop and store their adapters); futures nobody fetched go."""
        while True:
            await asyncio.sleep(REAP_S)
            try:
                await self._reap_once()
            except Exception:  # a round that failed is logged, and the next one runs
                log.exception("reaping Tinker sessions failed")

    async def _reap_once(self) -> None:
        now = time.monotonic()
        for session in [s for s in self.sessions.sessions.values() if not s.finished and now - s.heard > SILENT_S]:
            log.info("session %s of %s sent no heartbeat for %.0f s: ending it", session.id, session.tenant, SILENT_S)
            session.finished = True
            for model in self.sessions.of(session):
                try:
                    await self.sessions.end(model)
                except Exception as e:  # the scheduler away: stopped by hand, or its job pauses when idle
                    log.warning("session %s: model %s not stopped (%s)", session.id, model.id, e)
        self.futures.expire()

    async def close(self) -> None:
        await self.futures.close()
        await self.sessions.close()
