"""Send a file to the artifact service as chunk messages: streamed from disk, a bounded window in flight."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import uuid
from collections import deque

import aiofiles
import msgspec
import nats.errors
from nats.aio.client import Client

from schemas import names
from schemas.artifacts import CHUNK_BYTES, ArtifactInfo, ArtifactMeta, Chunk, ChunkAck

log = logging.getLogger(__name__)
_ack = msgspec.json.Decoder(ChunkAck)


class UploadError(Exception):
    """The artifact service refused the upload or never answered."""


async def upload_file(nc: Client, job: str, kind: str, path: str | os.PathLike, meta: ArtifactMeta | None = None,
                      window: int = 8, timeout: float = 15.0, attempts: int = 3,
                      chunk_bytes: int = CHUNK_BYTES) -> ArtifactInfo:
    """Upload `path`; retried from the start (as a new upload) when the service restarts or stalls."""
    last_error = None
    for attempt in range(1, attempts + 1):
        try:
            return await _upload_once(nc, job, kind, path, meta, window, timeout, chunk_bytes)
        except UploadError as e:
            last_error = e
            log.warning("upload of %s %s failed (attempt %d of %d): %s", job, kind, attempt, attempts, e)
            await asyncio.sleep(min(2.0 * attempt, 5.0))
    raise UploadError(f"could not upload the {kind} artifact of job {job} after {attempts} attempts: {last_error}; "
                      "is the artifact service running (jetlora artifacts)?")


async def _upload_once(nc, job, kind, path, meta, window, timeout, chunk_bytes) -> ArtifactInfo:
    upload = uuid.uuid4().hex
    subject = names.artifact_upload(job)
    digest = hashlib.sha256()
    size = 0
    in_flight: deque[asyncio.Task] = deque()

    async def settle(task: asyncio.Task) -> ChunkAck:
        try:
            msg = await task
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            raise UploadError(f"no acknowledgement from the artifact service ({type(e).__name__})") from None
        ack = _ack.decode(msg.data)
        if not ack.ok:
            raise UploadError(ack.error)
        return ack

    try:
        async with aiofiles.open(path, "rb") as f:
            seq = 0
            data = await f.read(chunk_bytes)
            while True:
                following = await f.read(chunk_bytes) if data else b""
                last = not following
                digest.update(data)
                size += len(data)
                chunk = Chunk(upload=upload, job=job, kind=kind, seq=seq, data=data, last=last,
                              sha256=digest.hexdigest() if last else "", size=size if last else 0,
                              meta=meta if seq == 0 else None)
                wait = timeout * 4 if last else timeout  # the last ack comes once the object is stored
                in_flight.append(asyncio.create_task(nc.request(subject, msgspec.msgpack.encode(chunk), timeout=wait)))
                if len(in_flight) >= window:
                    await settle(in_flight.popleft())
                if last:
                    break
                data, seq = following, seq + 1
        ack = None
        while in_flight:
            ack = await settle(in_flight.popleft())
        if ack is None or ack.stored is None:
            raise UploadError("the artifact service acknowledged the last chunk without storing the artifact")
        return ack.stored
    finally:
        for task in in_flight:
            task.cancel()
