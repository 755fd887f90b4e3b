"""`jetlora dashboard`: serves the page, its config (the WebSocket URL and the subjects), artifact downloads and
the Tinker sessions panel's data.

The page itself talks to NATS directly over WebSocket (heartbeats, the scheduler's lists, the registry's and the
evals service's, the jobs' events); this server (aiohttp, as the gateway's) is a NATS client for artifact downloads,
which it streams from the object store through a temporary file, and for the Tinker API's stored sessions
(tinker_view.py), whose calls' bodies a browser should not download.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import tempfile
from pathlib import Path

import msgspec
from aiohttp import web
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from schemas import names, nats_subjects
from services.dashboard.tinker_view import TinkerView
from services.aio import cancel_and_wait
from services.runtime import StartupError
from services.streamview import StaleView
from services.transfer.download import DownloadError, stored_name

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
KINDS = {"peft": "tar.gz", "gguf": "gguf", "checkpoint": "tar.gz", "tensorboard": "tar.gz"}
NO_STORE = {"Cache-Control": "no-store"}


def page_config(ws_url: str) -> dict:
    return {
        "ws_url": ws_url,
        "stream": names.JOBS_STREAM,
        "inbox_prefix": nats_subjects.inbox("dashboard"),
        "subjects": {
            "heartbeats": names.HEARTBEATS_ALL,
            "list_jobs": names.LIST_JOBS,
            "list_nodes": names.LIST_NODES,
            "job_events": names.job_events("{job}"),
            "job_progress": names.job("{job}").progress,
            "all_progress": names.JOB_PROGRESS_ALL,
            "artifacts_list": names.ARTIFACTS_LIST,
            "list_adapters": names.ADAPTERS.list,
            "eval_runs": names.evals_api().runs,
            "tenants": names.TENANTS,
        },
    }


class Dashboard:
    def __init__(self, nc: Client, ws_url: str, host: str = "127.0.0.1", port: int = 8222) -> None:
        self.nc, self.ws_url, self.host, self.port = nc, ws_url, host, port
        self.ready = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.tinker = TinkerView(nc.jetstream())

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.get("/", self._page),
                web.get("/index.html", self._page),
                web.get("/app.js", self._script),
                web.get("/config.json", self._config),
                web.get("/tinker.json", self._tinker),
                web.get("/favicon.ico", self._no_icon),
                web.get("/artifacts/{job}/{kind}", self._artifact),
            ]
        )
        return app

    async def start(self) -> None:
        """Bind the port; raises StartupError, saying what to do, when it is taken."""
        if self._runner is not None:
            return
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as e:
            await runner.cleanup()
            hint = " (8222 is also nats-server's usual monitoring port)" if self.port == 8222 else ""
            raise StartupError(
                f"the dashboard cannot listen on {self.host}:{self.port}{hint}: {e.strerror or e}; "
                "pass --port N for another port, or --port 0 for any free one"
            ) from None
        self._runner = runner
        self.port = runner.addresses[0][1]
        log.info("dashboard at http://%s:%d/ (NATS over %s)", self.host, self.port, self.ws_url)
        self.ready.set()

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        following = asyncio.create_task(self.tinker.run(stop), name="dashboard tinker view")
        try:
            await wait_first_or_raise(stop, following)
        finally:
            await cancel_and_wait([following])
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=(STATIC / "index.html").read_bytes(), content_type="text/html", charset="utf-8", headers=NO_STORE
        )

    async def _script(self, request: web.Request) -> web.Response:
        """Kept gzipped (the bundled NATS client and Chart.js); inflated for clients that do not take gzip."""
        body = (STATIC / "app.js.gz").read_bytes()
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(
                body=body,
                content_type="text/javascript",
                charset="utf-8",
                headers={**NO_STORE, "Content-Encoding": "gzip"},
            )
        return web.Response(
            body=gzip.decompress(body), content_type="text/javascript", charset="utf-8", headers=NO_STORE
        )

    async def _no_icon(self, request: web.Request) -> web.Response:
        """None: a browser's ask for one is answered, not logged as a missing page."""
        return web.Response(status=204)

    async def _config(self, request: web.Request) -> web.Response:
        return web.json_response(page_config(self.ws_url), headers=NO_STORE)

    async def _tinker(self, request: web.Request) -> web.Response:
        """The Tinker sessions panel: what the gateways stored (503 while the store cannot be read)."""
        try:
            panel = await self.tinker.panel()
        except StaleView as e:
            return web.json_response(
                {"error": f"the Tinker store is not readable now: {e}"}, status=503, headers=NO_STORE
            )
        return web.Response(body=msgspec.json.encode(panel), content_type="application/json", headers=NO_STORE)

    async def _artifact(self, request: web.Request) -> web.StreamResponse:
        job, kind = request.match_info["job"], request.match_info["kind"]
        if kind not in KINDS:
            raise web.HTTPNotFound(text=f"no artifact kind {kind}; kinds are {', '.join(KINDS)}")
        try:
            names.check_token(job, "job id")
        except ValueError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        obs = await self.nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
        with tempfile.TemporaryFile() as f:
            try:
                await obs.get(await stored_name(obs, job, kind), writeinto=f)
            except (NotFoundError, DownloadError):
                raise web.HTTPNotFound(text=f"no {kind} artifact for job {job}") from None
            size = f.tell()
            f.seek(0)
            response = web.StreamResponse(
                headers={
                    "Content-Type": "application/octet-stream",
                    "Content-Length": str(size),
                    "Content-Disposition": f'attachment; filename="{job}-{kind}.{KINDS[kind]}"',
                }
            )
            await response.prepare(request)
            while block := f.read(1 << 20):
                await response.write(block)
            await response.write_eof()
        log.info("served %s %s (%d bytes)", job, kind, size)
        return response


async def wait_first_or_raise(stop: asyncio.Event, task: asyncio.Task) -> None:
    """Until `stop`; a task that ends first (it should not: it follows until stopped) ends this with its error."""
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([stopping, task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait([stopping])
    if task.done() and not stop.is_set():
        task.result()
        raise RuntimeError("the dashboard's view of the Tinker store stopped following it")
