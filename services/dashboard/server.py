"""`jetlora dashboard`: serves the page, its config (the WebSocket URL and the subjects), and artifact downloads.

The page itself talks to NATS directly over WebSocket; this server is a NATS client only for
artifact downloads, which it streams from the object store through a temporary file.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from schemas import names
from services.artifacts.download import DownloadError, stored_name
from services.runtime import StartupError

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".json": "application/json"}
KINDS = {"peft": "tar.gz", "gguf": "gguf", "checkpoint": "tar.gz", "tensorboard": "tar.gz"}


def page_config(ws_url: str) -> dict:
    return {"ws_url": ws_url, "stream": names.JOBS_STREAM, "inbox_prefix": names.inbox("dashboard"), "subjects": {
        "heartbeats": names.HEARTBEATS_ALL, "list_jobs": names.LIST_JOBS, "list_nodes": names.LIST_NODES,
        "job_events": names.job_events("{job}"), "artifacts_list": names.ARTIFACTS_LIST,
        "list_adapters": names.ADAPTERS.list}}


class Dashboard:
    def __init__(self, nc: Client, ws_url: str, host: str = "127.0.0.1", port: int = 8222) -> None:
        self.nc, self.ws_url, self.host, self.port = nc, ws_url, host, port
        self.ready = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Bind the port; raises StartupError, saying what to do, when it is taken."""
        if self._server is not None:
            return
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as e:
            hint = " (8222 is also nats-server's usual monitoring port)" if self.port == 8222 else ""
            raise StartupError(f"the dashboard cannot listen on {self.host}:{self.port}{hint}: {e.strerror or e}; "
                               "pass --port N for another port, or --port 0 for any free one") from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("dashboard at http://%s:%d/ (NATS over %s)", self.host, self.port, self.ws_url)
        self.ready.set()

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        assert self._server is not None
        async with self._server:
            await stop.wait()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, target, _ = request_line.split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
            path = urlsplit(target).path
            if method != "GET":
                return await self._send(writer, 405, b"only GET", "text/plain")
            if path in ("/", "/index.html"):
                return await self._send(writer, 200, (STATIC / "index.html").read_bytes(), TYPES[".html"])
            if path == "/app.js":  # kept gzipped (the bundled NATS client and Chart.js); inflated for old clients
                body = (STATIC / "app.js.gz").read_bytes()
                if "gzip" in headers.get("accept-encoding", ""):
                    return await self._send(writer, 200, body, TYPES[".js"], "Content-Encoding: gzip\r\n")
                return await self._send(writer, 200, gzip.decompress(body), TYPES[".js"])
            if path == "/config.json":
                return await self._send(writer, 200, json.dumps(page_config(self.ws_url)).encode(), TYPES[".json"])
            parts = path.strip("/").split("/")
            if len(parts) == 3 and parts[0] == "artifacts" and parts[2] in KINDS:
                return await self._artifact(writer, parts[1], parts[2])
            await self._send(writer, 404, b"not found", "text/plain")
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def _send(self, writer, status: int, body: bytes, ctype: str, extra: str = "") -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request"}.get(status, "")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                     f"Cache-Control: no-store\r\nConnection: close\r\n{extra}\r\n".encode() + body)
        await writer.drain()

    async def _artifact(self, writer, job: str, kind: str) -> None:
        try:
            names.check_token(job, "job id")
        except ValueError as e:
            return await self._send(writer, 400, str(e).encode(), "text/plain")
        obs = await self.nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
        with tempfile.TemporaryFile() as f:
            try:
                info = await obs.get(await stored_name(obs, job, kind), writeinto=f)
            except (NotFoundError, DownloadError):
                return await self._send(writer, 404, f"no {kind} artifact for job {job}".encode(), "text/plain")
            size = f.tell()
            f.seek(0)
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {size}\r\n"
                         f"Content-Disposition: attachment; filename=\"{job}-{kind}.{KINDS[kind]}\"\r\n"
                         "Connection: close\r\n\r\n".encode())
            while block := f.read(1 << 20):
                writer.write(block)
                await writer.drain()
        log.info("served %s (%d bytes)", info.info.name if hasattr(info, "info") else job, size)
