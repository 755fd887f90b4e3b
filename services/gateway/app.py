"""The gateway's HTTP server (aiohttp): every /v1 request carries `Authorization: Bearer <key>` (the Tinker API's
under /api/v1, `X-API-Key: tml-<key>`); the key's tenant is the only tenant the request acts as. It talks to jetlora's services over NATS only, like any client."""

from __future__ import annotations

import asyncio

from aiohttp import web

from schemas import names
from services.gateway.answers import openai_errors
from services.gateway.errors import JSON_MAX, json_response
from services.gateway.evals.routes import Evals
from services.gateway.faults import FAULTS, Faults
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

REQUESTS_GRACE_S = 5.0  # what requests under way have to finish once the gateway stops


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

    async def healthz(request: web.Request) -> web.Response:
        return json_response({"ok": nc.is_connected, "faults": app[FAULTS].count})

    records, events = JobRecords(nc.jetstream(), jobs_kv), JobEvents(nc)
    tinker = TinkerApi(nc, keys, models, tinker_settings or TinkerSettings(idle_s=tinker_idle_s))
    faults = Faults()
    app = web.Application(middlewares=[openai_errors(keys, faults), TinkerApi.refusals], client_max_size=JSON_MAX)
    app[FAULTS] = faults
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
        # at a stop, requests under way (a long poll, an upload) get REQUESTS_GRACE_S, not aiohttp's 60 s: the
        # service's whole shutdown has --shutdown-timeout, and a client retries a cut request on the next gateway
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=REQUESTS_GRACE_S)
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
