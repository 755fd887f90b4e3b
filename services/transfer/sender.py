"""Send a file (an artifact, a dataset) to the artifact service as chunk messages: streamed from disk, a bounded window in flight."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiofiles
import msgspec
import nats.errors
from nats.aio.client import Client

from schemas import names
from schemas.artifacts import CHUNK_BYTES, ArtifactInfo, ArtifactKind, ArtifactMeta, Chunk, ChunkAck
from schemas.datasets import DatasetChunk, DatasetChunkAck, DatasetInfo, DatasetUpload, check_new_name
from schemas.jobs import Error

log = logging.getLogger(__name__)
_ack = msgspec.json.Decoder(ChunkAck)
_dataset_ack = msgspec.json.Decoder(DatasetChunkAck)
_error = msgspec.json.Decoder(Error)
T = TypeVar("T")
MakeChunk = Callable[[str, int, bytes, bool, str, int], T]  # (upload, seq, data, last, sha256, size) -> a chunk


class UploadError(Exception):
    """The artifact service refused the upload or never answered."""


class Refusal(UploadError):
    """The service answered and refused the upload (a bad row, a name taken): sending it again will not help."""


@dataclass(frozen=True)
class Sending:
    """How a file is sent, tuned together: `window` chunks awaiting their acks, `timeout` s for an ack (four times
    that for the last, which comes once the object is stored), `attempts` from the start, `chunk_bytes` a chunk."""

    window: int = 8
    timeout: float = 15.0
    attempts: int = 3
    chunk_bytes: int = CHUNK_BYTES


async def upload_file(
    nc: Client,
    node: str,
    job: str,
    kind: ArtifactKind,
    path: str | os.PathLike,
    meta: ArtifactMeta | None = None,
    **sending: Any,
) -> ArtifactInfo:
    """Upload an artifact of a job this node runs; retried from the start (as a new upload) when the service
    restarts or stalls, never when it refuses. `sending`: Sending's fields (window, timeout, attempts, chunk_bytes)."""
    chunk = _chunks(Chunk, meta, job=job, kind=kind)
    what = f"the {kind} artifact of job {job}"
    return await _upload(nc, names.artifact_upload(node, job), path, chunk, _ack, what, Sending(**sending))


async def upload_dataset(
    nc: Client,
    name: str,
    path: str | os.PathLike,
    upload: DatasetUpload | None = None,
    tenant: str | None = None,
    **sending: Any,
) -> DatasetInfo:
    """Upload a dataset file; the service checks every row before storing it. A refusal (Refusal) is final; a
    service that went quiet is tried again from the start. `sending`: Sending's fields."""
    check_new_name(name)  # ValueError: refused here, before a byte is sent
    chunk = _chunks(DatasetChunk, upload or DatasetUpload(), name=name)
    subject = names.dataset_upload(name, tenant)
    return await _upload(nc, subject, path, chunk, _dataset_ack, f"dataset {name}", Sending(**sending))


def _chunks(struct: Callable[..., T], meta: object, **fields: object) -> MakeChunk[T]:
    """A function that makes the chunks of one upload: `struct` with `fields`, and `meta` on the first chunk only."""

    def chunk(upload: str, seq: int, data: bytes, last: bool, sha256: str, size: int) -> T:
        return struct(
            upload=upload,
            seq=seq,
            data=data,
            last=last,
            sha256=sha256,
            size=size,
            meta=meta if seq == 0 else None,
            **fields,
        )

    return chunk


async def _upload(nc: Client, subject: str, path, make_chunk, ack_decoder, what: str, sending: Sending):
    """send_file until it stores the upload, from the start each attempt; a refusal is raised at once (the same
    again would be refused too), a service that went quiet is tried again after a pause."""
    for attempt in range(1, sending.attempts + 1):
        try:
            return await send_file(nc, subject, path, make_chunk, ack_decoder, sending)
        except Refusal:
            raise
        except UploadError as e:
            if attempt == sending.attempts:
                raise UploadError(
                    f"could not upload {what} after {sending.attempts} attempts: {e}; is the artifact service "
                    "running (jetlora artifacts)?"
                ) from None
            log.warning("upload of %s failed (attempt %d of %d): %s", what, attempt, sending.attempts, e)
            await asyncio.sleep(min(2.0 * attempt, 5.0))
    raise UploadError(f"could not upload {what}: attempts is {sending.attempts}; give at least 1")


def _decoded(data: bytes, ack_decoder):
    """A chunk's ack; an error reply in its place (what a request endpoint answers) is a refusal, anything else that
    is no ack an UploadError: never a raw decoding error to the sender's caller."""
    try:
        return ack_decoder.decode(data)
    except msgspec.DecodeError as e:
        try:
            error = _error.decode(data)
        except msgspec.DecodeError:
            raise UploadError(f"the artifact service's reply is not an acknowledgement ({e})") from None
        raise Refusal(f"{error.field}: {error.error}" if error.field else error.error) from None


async def send_file(nc: Client, subject: str, path, make_chunk, ack_decoder, sending: Sending):
    """One attempt: stream `path` as chunks on `subject`, sending.window awaiting their acks; returns what the last
    ack says was stored."""
    window, timeout, chunk_bytes = sending.window, sending.timeout, sending.chunk_bytes
    upload = uuid.uuid4().hex
    digest = hashlib.sha256()
    size = 0
    in_flight: deque[asyncio.Task] = deque()

    async def settle(task: asyncio.Task):
        try:
            msg = await task
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            raise UploadError(f"no acknowledgement from the artifact service ({type(e).__name__})") from None
        ack = _decoded(msg.data, ack_decoder)
        if not ack.ok:  # the service's own trouble may pass when sent again; a refusal never does
            raise (UploadError if ack.retry else Refusal)(ack.error)
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
                chunk = make_chunk(upload, seq, data, last, digest.hexdigest() if last else "", size if last else 0)
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
            raise UploadError("the service acknowledged the last chunk without storing the upload")
        return ack.stored
    finally:
        for task in in_flight:
            task.cancel()
