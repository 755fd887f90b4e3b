"""The gateway's HTTP server (aiohttp): every /v1 request carries `Authorization: Bearer <key>` (the Tinker API's
under /api/v1, `X-API-Key: tml-<key>`); the key's tenant is the only tenant the request acts as. It talks to jetlora's services over NATS only, like any client."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from schemas import names
from services.bus import RequestError
from services.gateway.errors import JSON_MAX, TENANT, OpenAIError, error_response, json_response, too_large
from services.gateway.evals import Evals
from services.gateway.faults import FAULTS, REQUEST_ID_HEADER, Faults, request_id, unforeseen
from services.gateway.events import JobEvents
from services.gateway.files import Files, UploadLimits
from services.gateway.graders import Graders
from services.gateway.jobs import Jobs
from services.gateway.keys import KeyStore
from services.gateway.models import Models
from services.gateway.openai_map import BaseModel
from services.gateway.records import JobRecords
from services.gateway.results import Results
from services.gateway.tinker.api import TinkerApi
from services.gateway.tinker.settings import TinkerSettings
from services.graders import GraderContext

log = logging.getLogger(__name__)


def make_app(
    nc,
    keys: KeyStore,
    jobs_kv,
    models: dict[str, BaseModel],
    spool_dir: str | None = None,
    graders: GraderContext | None = None,
    tinker_idle_s: float = 900.0,
    uploads: UploadLimits = UploadLimits(),
    tinker_settings: TinkerSettings | None = None,
) -> web.Application:
    """Every body is read whole only up to JSON_MAX (client_max_size); an upload is streamed to the spool.
    `graders`: where the graders endpoints may run what (default: no judge engine, python graders only isolated);
    `tinker_idle_s`: how long a Tinker training session may go without a call before its device is freed (or all
    of the Tinker API's settings in `tinker_settings`);
    `uploads`: the most one file, and one tenant's files together, may hold."""

    @web.middleware
    async def openai_errors(request: web.Request, handler):
        ident = request_id()
        response = await _answer(request, handler, ident)
        if not response.prepared:
            response.headers[REQUEST_ID_HEADER] = ident
        return response

    async def _answer(request: web.Request, handler, ident: str) -> web.StreamResponse:
        try:
            if request.path.startswith("/v1/"):
                request[TENANT] = await _tenant(request, keys)
            return await handler(request)
        except OpenAIError as e:
            return error_response(e)
        except RequestError as e:  # a service did not answer: ours, not the client's
            log.warning("%s %s: %s", request.method, request.path, e)
            return error_response(OpenAIError(503, f"{e}", None, "service_unavailable", "server_error"))
        except web.HTTPRequestEntityTooLarge:
            return error_response(too_large())
        except ConnectionResetError:  # the client went away mid-body: nobody reads this, nothing to log loudly
            log.info("%s %s: the client went away before the body ended", request.method, request.path)
            return error_response(OpenAIError(400, "the request ended before its body did; send it again"))
        except web.HTTPException as e:
            return error_response(OpenAIError(e.status, e.reason, None, None))
        except Exception:  # a fault of ours that no handler foresaw: OpenAI's shape, logged with its request id
            return error_response(unforeseen(request, ident, app[FAULTS]))

    async def healthz(request: web.Request) -> web.Response:
        return json_response({"ok": nc.is_connected, "faults": app[FAULTS].count})

    records, events = JobRecords(nc.jetstream(), jobs_kv), JobEvents(nc)
    tinker = TinkerApi(nc, keys, models, tinker_settings or TinkerSettings(idle_s=tinker_idle_s))
    app = web.Application(middlewares=[openai_errors, TinkerApi.refusals], client_max_size=JSON_MAX)
    app[FAULTS] = Faults()
    grading = Graders(graders or GraderContext())
    app.add_routes(
        Files(nc, Results(nc, events, records), spool_dir, uploads).routes()
        + Jobs(nc, records, events, models, grading).routes()
        + Models(nc, models).routes()
        + grading.routes()
        + Evals(nc, models, grading, spool_dir).routes()
        + tinker.routes()
        + [web.get("/healthz", healthz)]
    )

    async def run_tinker(_app):
        await tinker.start()
        yield
        await tinker.close()

    app.cleanup_ctx.append(run_tinker)
    return app


async def _tenant(request: web.Request, keys: KeyStore) -> str:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    tenant = await keys.tenant_of(key.strip()) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise OpenAIError(
            401,
            "Incorrect API key provided. Keys are made with `jetlora keys create --tenant T`.",
            None,
            "invalid_api_key",
        )
    return tenant


class Gateway:
    """Bind first (a taken port stops the command before anything else), then serve until stopped."""

    def __init__(
        self,
        nc,
        models: dict[str, BaseModel],
        host: str = "127.0.0.1",
        port: int = 8000,
        spool_dir: str | None = None,
        graders: GraderContext | None = None,
        tinker_idle_s: float = 900.0,
        uploads: UploadLimits = UploadLimits(),
        tinker_settings: TinkerSettings | None = None,
    ) -> None:
        self.nc, self.models, self.host, self.port, self.spool_dir = nc, models, host, port, spool_dir
        self.graders, self.tinker_idle_s, self.uploads = graders, tinker_idle_s, uploads
        self.tinker_settings = tinker_settings
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        js = self.nc.jetstream()
        jobs_kv = await js.key_value(names.GATEWAY_JOBS_KV)
        keys = await KeyStore.open(js)
        app = make_app(
            self.nc,
            keys,
            jobs_kv,
            self.models,
            self.spool_dir,
            self.graders,
            self.tinker_idle_s,
            self.uploads,
            self.tinker_settings,
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0:
            self.port = self._runner.addresses[0][1]

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await stop.wait()
        finally:
            await self.close()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
