"""The artifact service: assembles chunked uploads into the object store; lists and deletes artifacts."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field

import msgspec
import nats.micro
from nats.aio.client import Client

from schemas import names
from schemas.artifacts import (ArtifactInfo, ArtifactList, ArtifactMeta, ArtifactQuery, Chunk, ChunkAck,
                               Deleted)
from schemas.jobs import Error
from services import __version__, bus
from services.aio import cancel_and_wait, sleep_unless_stopped
from services.artifacts.objinfo import artifact_headers, info_from_object, sha256_header
from services.artifacts.objwriter import ObjectWriter

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
_chunk = msgspec.msgpack.Decoder(Chunk)
MAX_AHEAD = 32  # chunks buffered out of order before a gap fails the upload


@dataclass
class Upload:
    chunk0: Chunk
    writer: ObjectWriter
    expected: int = 0
    size: int = 0
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    ahead: dict[int, tuple[Chunk, object]] = field(default_factory=dict)
    touched: float = field(default_factory=time.monotonic)
    failed: str = ""
    aborted: asyncio.Future | None = None


class ArtifactService:
    def __init__(self, nc: Client, stall_timeout: float = 30.0) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.stall_timeout = stall_timeout
        self.uploads: dict[str, Upload] = {}
        self.failed: dict[str, tuple[str, float]] = {}  # upload -> reason, kept so late chunks get it
        self.stored = 0
        self.ready = asyncio.Event()
        self._aborts: set[asyncio.Future] = set()

    async def run(self, stop: asyncio.Event) -> None:
        self.obs = await self.js.object_store(names.ARTIFACTS_BUCKET)
        sub = await self.nc.subscribe(names.ARTIFACTS_UPLOAD_ALL, queue="jetlora-artifacts", cb=self._on_chunk,
                                      pending_msgs_limit=4096, pending_bytes_limit=256 * 1024 * 1024)
        service = await nats.micro.add_service(self.nc, name=names.ARTIFACT_SERVICE, version=__version__,
                                               description="jetlora artifact store")
        group = service.add_group(name=names.ARTIFACTS_GROUP)
        for verb, serve in (("list", self._list), ("delete", self._delete)):  # an admin's, and each tenant's
            answer = bus.handler(lambda q, subject, serve=serve: serve(q, names.tenant_of_subject(subject)),
                                 ArtifactQuery, with_subject=True)
            await group.add_endpoint(name=verb, handler=answer)
            await group.add_endpoint(name=f"tenant-{verb}", subject=f"*.{verb}", handler=answer)
        reaper = asyncio.create_task(self._reap_stalled(stop))
        await self.nc.flush()
        self.ready.set()
        log.info("artifact service up, bucket %s", names.ARTIFACTS_BUCKET)
        try:
            await stop.wait()
        finally:
            await cancel_and_wait([reaper])
            await service.stop()
            await sub.unsubscribe()
            for up in list(self.uploads.values()):
                self._fail(up, "the artifact service shut down mid-upload; the sender restarts it")
            await asyncio.gather(*self._aborts, return_exceptions=True)  # purges finish before the service ends

    # --- uploads -------------------------------------------------------------------------------
    async def _reply(self, msg, chunk: Chunk, error: str = "", stored: ArtifactInfo | None = None) -> None:
        if msg.reply:
            await msg.respond(_enc.encode(ChunkAck(upload=chunk.upload, seq=chunk.seq, ok=not error, error=error,
                                                   stored=stored)))

    async def _on_chunk(self, msg) -> None:
        try:
            chunk = _chunk.decode(msg.data)
        except msgspec.DecodeError as e:
            if msg.reply:
                await msg.respond(_enc.encode(ChunkAck(upload="", seq=-1, ok=False, error=f"not a chunk: {e}")))
            return
        if chunk.job != msg.subject.rsplit(".", 1)[-1]:
            return await self._reply(msg, chunk, f"chunk for job {chunk.job} sent on {msg.subject}")
        if chunk.upload in self.failed:
            return await self._reply(msg, chunk, self.failed[chunk.upload][0])
        up = self.uploads.get(chunk.upload)
        if up is None:
            if chunk.seq != 0:
                return await self._reply(msg, chunk, f"upload {chunk.upload} is not known here (the service restarted?); "
                                                     "restart it from chunk 0")
            up = self._begin(chunk)
        up.touched = time.monotonic()
        if chunk.seq < up.expected:
            return await self._reply(msg, chunk)  # a duplicate (redelivery): already taken
        if chunk.seq > up.expected:
            if chunk.seq - up.expected > MAX_AHEAD or chunk.seq in up.ahead:
                return await self._fail_reply(up, msg, chunk, f"chunk {up.expected} never arrived (got {chunk.seq})")
            up.ahead[chunk.seq] = (chunk, msg)
            return
        await self._take(up, chunk, msg)
        while up.expected in up.ahead and not up.failed:
            await self._take(up, *up.ahead.pop(up.expected))

    def _begin(self, chunk: Chunk) -> Upload:
        name = names.artifact_name(chunk.job, chunk.kind)
        headers = artifact_headers(chunk.job, chunk.kind, chunk.meta or ArtifactMeta())
        writer = ObjectWriter(self.js, names.ARTIFACTS_BUCKET, name, f"jetlora {chunk.kind} artifact of job {chunk.job}",
                              headers)
        up = Upload(chunk0=chunk, writer=writer)
        self.uploads[chunk.upload] = up
        log.info("upload %s: %s begins", chunk.upload, name)
        return up

    async def _take(self, up: Upload, chunk: Chunk, msg) -> None:
        up.expected += 1
        up.size += len(chunk.data)
        up.digest.update(chunk.data)
        try:
            await up.writer.write(chunk.data)
        except Exception as e:
            return await self._fail_reply(up, msg, chunk, f"the object store refused a chunk: {e}")
        if not chunk.last:
            return await self._reply(msg, chunk)
        sha = up.digest.hexdigest()
        if chunk.size != up.size or chunk.sha256 != sha:
            return await self._fail_reply(up, msg, chunk, f"checksum mismatch: the sender says {chunk.size} bytes sha256 "
                                                          f"{chunk.sha256[:12]}…, {up.size} bytes sha256 {sha[:12]}… arrived")
        key, value = sha256_header(sha)
        up.writer.info.headers[key] = value
        try:
            info = await up.writer.commit(up.digest.digest())
        except Exception as e:
            return await self._fail_reply(up, msg, chunk, f"the object store refused the artifact: {e}")
        del self.uploads[chunk.upload]
        self.stored += 1
        stored = info_from_object(info)
        log.info("upload %s: stored %s (%d bytes)", chunk.upload, info.name, up.size)
        await self._reply(msg, chunk, stored=stored)

    def _fail(self, up: Upload, reason: str) -> None:
        if up.failed:
            return
        up.failed = reason
        up.aborted = asyncio.ensure_future(up.writer.abort())
        self._aborts.add(up.aborted)
        up.aborted.add_done_callback(self._aborts.discard)
        self.uploads.pop(up.chunk0.upload, None)
        self.failed[up.chunk0.upload] = (reason, time.monotonic())
        log.warning("upload %s of %s %s failed: %s; nothing was stored", up.chunk0.upload, up.chunk0.job,
                    up.chunk0.kind, reason)

    async def _fail_reply(self, up: Upload, msg, chunk: Chunk, reason: str) -> None:
        self._fail(up, reason)
        try:
            await up.aborted  # its chunks are purged: no object appears
        except Exception as e:
            log.warning("upload %s: purging its chunks failed: %s", chunk.upload, e)
        await self._reply(msg, chunk, reason)
        for c, m in up.ahead.values():
            await self._reply(m, c, reason)

    async def _reap_stalled(self, stop: asyncio.Event) -> None:
        while not await sleep_unless_stopped(stop, min(1.0, self.stall_timeout / 4)):
            now = time.monotonic()
            for up in list(self.uploads.values()):
                if now - up.touched > self.stall_timeout:
                    self._fail(up, f"upload stalled at chunk {up.expected} for {self.stall_timeout:.0f}s "
                                   "(the sender went away); nothing was stored")
            self.failed = {k: v for k, v in self.failed.items() if now - v[1] < 600}

    # --- operators' requests -------------------------------------------------------------------
    async def list_artifacts(self, q: ArtifactQuery, tenant: str | None = None) -> list[ArtifactInfo]:
        """Artifacts matching the query; a tenant's own only, when one asks."""
        try:
            objects = await self.obs.list(ignore_deletes=True)
        except Exception:  # nats-py raises NotFoundError on an empty bucket
            objects = []
        out = [a for a in map(info_from_object, objects) if a]
        return [a for a in out if (q.job is None or a.job == q.job) and (q.kind is None or a.kind == q.kind)
                and (tenant is None or a.tenant == tenant)]

    async def _list(self, q: ArtifactQuery, tenant: str | None) -> ArtifactList:
        return ArtifactList(await self.list_artifacts(q, tenant))

    async def _delete(self, q: ArtifactQuery, tenant: str | None) -> Deleted | Error:
        if q.job is None:
            return Error("say which job's artifacts to delete", field="job")
        gone = []
        for a in await self.list_artifacts(q, tenant):
            await self.obs.delete(a.name)
            gone.append(a.name)
        return Deleted(gone)
