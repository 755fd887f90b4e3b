"""The Tinker API under /api/v1/, beside the OpenAI routes and with the same per-tenant keys, so the official `tinker`
client drives jetlora step by step (TINKER_BASE_URL = the gateway, TINKER_API_KEY = tml-<a jetlora key>): the
client's handshake (client/config), sessions and their heartbeats, the fleet's base models, model info, futures
(retrieve_future, a long poll) and the end of a session; the training, sampling and RestClient routes are
training.py's, sampling.py's and runs.py's. Everything a client was told lives in JetStream (store.py): any gateway
answers any client, and one that restarts loses nothing."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time

from aiohttp import web

from schemas.tinker_store import SessionRecord, session_key, valid_id
from services.gateway.keys import KeyStore
from services.gateway.openai_map import BaseModel
from services.gateway.tinker import proto
from services.gateway.tinker.bounds import Bounds
from services.gateway.tinker.common import PREFIX, Ctx
from services.gateway.tinker.completions import Completions
from services.gateway.tinker.exports import Exports
from services.gateway.tinker.futures import Book
from services.gateway.tinker.http import Fault, TinkerRefusal, body, fault_reply, field, logged_fault, refused, reply
from services.gateway.tinker.mirror import Liveness, Mirror
from services.gateway.tinker.order import Order
from services.gateway.tinker.outcomes import Runner
from services.gateway.tinker.reaper import Reaper
from services.gateway.tinker.runs import Runs
from services.gateway.tinker.sampling import Sampling
from services.gateway.tinker.saves import Saves
from services.gateway.tinker.serving import job_running
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from services.gateway.tinker.trainers import Trainers
from services.gateway.tinker.training import Training

log = logging.getLogger(__name__)
CLOSE_WRITE_S = 2.0  # the liveness record's delete at close, at most
CHUNK_BYTES = 150_000  # a forward_backward request's protobuf at most: its JSON on the bus is a few times larger


class TinkerApi:
    def __init__(
        self, nc, keys: KeyStore, models: dict[str, BaseModel], settings: TinkerSettings | None = None
    ) -> None:
        self.nc, self.gateway = nc, "gw-" + secrets.token_hex(6)
        self.settings = settings or TinkerSettings()
        store = Store(nc)
        book, trainers, mirror = Book(store), Trainers(nc, store), Mirror(store)
        bounds = Bounds(store, self.settings, job_running(trainers))  # serving samplers' places: while their jobs run
        saves = Saves(store, bounds)
        self.order = Order(store, mirror, book, Runner(store, book, trainers, saves), self.gateway, self.settings)
        mirror.on_call = self.order.written
        self.ctx = Ctx(self.gateway, keys, models, self.settings, store, mirror, book, self.order, trainers, bounds,
                       saves)  # fmt: skip
        self.reaper = Reaper(store, mirror, book, trainers, self.settings, bounds, saves)
        bounds.yields = self.reaper.yield_silent  # a silent session's places go to its tenant's next need
        self.liveness = Liveness(store, self.gateway)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Open the buckets, follow them, say this gateway is up; then reap and beat until closed."""
        await self.ctx.store.open()
        await self.liveness.beat()
        await self.ctx.mirror.start()
        self._tasks = [asyncio.create_task(self.reaper.run()), asyncio.create_task(self.liveness.run())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.order.close()
        try:
            if self.nc.is_connected:  # the bus away: nothing to wait on (a shutdown must not wait for it)
                # its models are taken over at once by the next gateway a client calls
                await asyncio.wait_for(self.liveness.end(), CLOSE_WRITE_S)
        except Exception as e:  # the server gone first: they are taken over LIVE_S from now
            log.info("the gateway's liveness record was not deleted (%s)", type(e).__name__ if not str(e) else e)
        await self.ctx.mirror.close()

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
            ]
            + Training(self.ctx).routes()
            + Sampling(self.ctx).routes()
            + Runs(self.ctx).routes()
            + Completions(self.ctx).routes()  # OpenAI's, under /v1, of tinker:// sampler paths
            + Exports(self.ctx).routes()
        )

    @staticmethod
    @web.middleware
    async def refusals(request: web.Request, handler):
        """Under /api/v1: a refusal in the shape the client shows (and does not retry); a fault nobody foresaw as a
        500 in the same shape, naming the request id its traceback is logged under. Never a bare 5xx."""
        if not request.path.startswith(PREFIX + "/"):
            return await handler(request)
        try:
            return await handler(request)
        except TinkerRefusal as e:
            return refused(e)
        except Fault as e:
            return fault_reply(e)
        except web.HTTPException as e:  # a route or method that does not exist, a body over the limit
            if e.status >= 500:
                return fault_reply(logged_fault(request))
            return reply({"detail": f"{e.reason}: {request.method} {request.path}"[:300]}, e.status)
        except ConnectionResetError:  # the client went away mid-body: nobody reads the answer
            return reply({"detail": "the request ended before its body did; send it again"}, 400)
        except asyncio.CancelledError:
            raise
        except Exception:
            return fault_reply(logged_fault(request))

    async def client_config(self, request: web.Request) -> web.Response:
        await self.ctx.tenant(request)  # a bad key is told at the client's first call
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
        await self.ctx.tenant(request)
        return reply({})

    async def create_session(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        tenant, data = await ctx.tenant(request), await body(request)
        metadata = data.get("user_metadata")
        kept = (
            {str(k)[:100]: v[:1000] for k, v in metadata.items() if isinstance(v, str)}
            if isinstance(metadata, dict)
            else None
        )
        now, retried = time.time(), request.headers.get("X-Idempotency-Key", "")
        ident = _session_id(tenant, retried)
        if retried and await ctx.store.get(ctx.store.kv, session_key(tenant, ident), SessionRecord) is not None:
            return reply({"session_id": ident})  # a retry whose first try's answer was lost: the same session
        session = SessionRecord(id=ident, tenant=tenant, created=now, heard=now,
                                user_metadata=dict(list(kept.items())[:32]) if kept else None)  # fmt: skip
        await ctx.bounds.session(tenant, session.id)  # its place first: a bound that holds on every gateway
        revision = await ctx.store.create(ctx.store.kv, session_key(tenant, session.id), session)
        if revision is None and retried:
            return reply({"session_id": ident})  # its first try, on another gateway, wrote it just now
        if revision is None:
            raise TinkerRefusal(409, "that session id was just taken; create the session again")
        ctx.mirror.learn(session, revision)
        return reply({"session_id": session.id})

    async def heartbeat(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        tenant, data = await ctx.tenant(request), await body(request)
        session, _ = await ctx.session(tenant, field(data, "session_id"))
        if session.finished is not None:
            return reply({"detail": "the session has finished"}, 410)

        def heard(s: SessionRecord) -> bool:
            s.heard, s.paused = time.time(), False
            return s.finished is None

        written = await ctx.store.modify(ctx.store.kv, session_key(tenant, session.id), SessionRecord, heard)
        if written is None or written.finished is not None:
            return reply({"detail": "the session has finished"}, 410)
        return reply({"type": "session_heartbeat"})

    async def telemetry(self, request: web.Request) -> web.Response:
        await self.ctx.tenant(request)
        return reply({"status": "accepted"})  # the client's own diagnostics: not kept

    async def capabilities(self, request: web.Request) -> web.Response:
        await self.ctx.tenant(request)
        models = [{"model_name": name, "trainable": True, "sampleable": True} for name in sorted(self.ctx.models)]
        return reply({"supported_models": models})

    async def get_info(self, request: web.Request) -> web.Response:
        tenant, data = await self.ctx.tenant(request), await body(request)
        model = await self.ctx.model(tenant, field(data, "model_id"))
        info = model.info
        if info is None:
            raise TinkerRefusal(404, f"training model {model.id} has not started yet: fetch its create_model first")
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
        ctx = self.ctx
        tenant, data = await ctx.tenant(request), await body(request)
        request_id = field(data, "request_id")
        unknown = TinkerRefusal(404, f"no request {request_id[:200]!r} of yours (or its result expired: kept a day)")
        known, outcome = await ctx.book.from_memory(tenant, request_id)
        if not known:
            future = await ctx.book.find(tenant, request_id) if valid_id(request_id) else None
            if future is None:
                raise unknown
            try:
                outcome = await ctx.book.from_store(future, ctx.order.revive)
            except KeyError:
                raise unknown from None
        if outcome is None:  # not done yet: the client asks again at once, quietly
            return reply({"type": "try_again", "request_id": request_id, "queue_state": "active"}, 408)
        if outcome.body is not None:
            return web.Response(body=outcome.body, content_type=proto.CONTENT_TYPE)
        return reply(outcome.json)

    async def finish(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        tenant = await ctx.tenant(request)
        session, _ = await ctx.session(tenant, request.match_info["id"], "the path's session id")

        ended: list[SessionRecord] = []

        def finished(s: SessionRecord) -> bool:
            ended[:] = [] if s.finished is not None else [s]
            s.finished = s.finished or time.time()
            return bool(ended)

        await ctx.store.modify(ctx.store.kv, session_key(tenant, session.id), SessionRecord, finished)
        for written in ended:
            await self.reaper.end(written, "its client finished it")  # each stores its adapter, to register
        return reply({})


def _session_id(tenant: str, retried: str) -> str:
    """A new session's id: of the client's X-Idempotency-Key where it sent one (the official client keeps it across
    its retries of one request, on whichever gateway they reach), else random."""
    if not retried:
        return "sess-" + secrets.token_hex(8)
    return "sess-" + hashlib.sha256(f"{tenant}\n{retried}".encode()).hexdigest()[:16]
