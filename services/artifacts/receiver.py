"""Chunked uploads assembled into object-store entries: in order, sha256-checked, all or nothing.

One receiver serves one kind of upload (artifacts, datasets). What differs between them, where the object goes,
what is checked on the way and what the last ack says, is a Sink the caller opens for each upload.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from services.aio import sleep_unless_stopped
from services.artifacts.objwriter import ObjectWriter

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
MAX_AHEAD = 32  # chunks buffered out of order before a gap fails the upload
AHEAD_MIB_PER_UPLOAD = 64  # bytes one upload may hold out of order (a sender's window is 8 chunks of 512 KiB)
AHEAD_MIB_TOTAL = 256  # and all uploads together: beyond it, the upload that asks for more is refused
FAILED_KEPT_S = 600.0  # a failed upload's reason is given to its late chunks this long


class Refused(Exception):
    """A sink refuses the upload: the reason goes back to the sender and nothing is stored."""


@dataclass(frozen=True)
class Failure:
    """Why an upload failed, and whether that was the service's own trouble (retry: the sender may send it again
    from chunk 0) rather than a refusal of what was sent."""

    reason: str
    retry: bool = False
    when: float = field(default_factory=time.monotonic)


class AnyChunk(Protocol):
    """What every kind of chunk message holds (schemas.artifacts.Chunk, schemas.datasets.DatasetChunk)."""

    upload: str
    seq: int
    data: bytes
    last: bool
    sha256: str
    size: int


C = TypeVar("C", bound=AnyChunk)


def _retry(reason: str) -> Failure:
    """A failure of the service's own: the sender may send the upload again."""
    return Failure(reason, retry=True)


class Sink(Protocol):
    writer: ObjectWriter
    what: str  # for logs: "gguf artifact of job X", "dataset chat-v2"

    def check(self, data: bytes) -> None:
        """Look at the next bytes before they are stored; raise Refused to refuse the upload."""

    async def commit(self, sha256: str, digest: bytes) -> msgspec.Struct:
        """Make the object visible; returns what the last chunk's ack carries. Raise Refused to refuse it."""


@dataclass
class Upload(Generic[C]):
    chunk0: C
    sink: Sink
    expected: int = 0
    size: int = 0
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    ahead: dict[int, tuple[C, Any]] = field(default_factory=dict)
    ahead_bytes: int = 0
    held: list = field(default_factory=list)  # a failed upload's out-of-order chunks, still to be answered
    touched: float = field(default_factory=time.monotonic)
    failed: Failure | None = None
    aborted: asyncio.Future | None = None


class ChunkReceiver(Generic[C]):
    """Turns chunk messages (msgpack, each with upload, seq, data, last, sha256, size) into objects."""

    def __init__(
        self,
        chunk_type: type[C],
        ack_type: type,
        target: Callable[[C], str],
        open_sink: Callable[[C, str], Awaitable[Sink]],
        stall_timeout: float = 30.0,
        ahead_mib_per_upload: int = AHEAD_MIB_PER_UPLOAD,
        ahead_mib_total: int = AHEAD_MIB_TOTAL,
    ) -> None:
        """open_sink(first chunk, its subject) -> where the upload goes; raises Refused to refuse it."""
        self.decoder: msgspec.msgpack.Decoder[C] = msgspec.msgpack.Decoder(chunk_type)
        self.ack_type, self.target, self.open_sink = ack_type, target, open_sink
        self.stall_timeout = stall_timeout
        self.uploads: dict[str, Upload[C]] = {}
        self.failed: dict[str, Failure] = {}  # upload -> why, kept so late chunks get it
        self.stored = 0
        self.ahead_limit, self.ahead_total_limit = ahead_mib_per_upload << 20, ahead_mib_total << 20
        self.ahead_bytes = 0  # held out of order by all uploads
        self._aborts: set[asyncio.Future] = set()

    async def _reply(self, msg, chunk, error: str | Failure = "", stored: msgspec.Struct | None = None) -> None:
        """Ack a chunk; with `error` (a Failure, or a refusal's reason) the upload failed."""
        failure = error if isinstance(error, Failure) else Failure(error)
        if msg.reply:
            ok, error, retry = not failure.reason, failure.reason, failure.retry
            ack = self.ack_type(upload=chunk.upload, seq=chunk.seq, ok=ok, error=error, stored=stored, retry=retry)
            await msg.respond(_enc.encode(ack))

    async def on_chunk(self, msg) -> None:
        try:
            chunk = self.decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            if msg.reply:
                await msg.respond(_enc.encode(self.ack_type(upload="", seq=-1, ok=False, error=f"not a chunk: {e}")))
            return
        msg.data = b""  # decoded: the chunk holds its own copy, and a chunk kept out of order should not hold two
        if self.target(chunk) != msg.subject.rsplit(".", 1)[-1]:
            return await self._reply(msg, chunk, f"chunk for {self.target(chunk)} sent on {msg.subject}")
        if chunk.upload in self.failed:
            return await self._reply(msg, chunk, self.failed[chunk.upload])
        up = self.uploads.get(chunk.upload)
        if up is None:
            if chunk.seq != 0:
                return await self._reply(
                    msg,
                    chunk,
                    _retry(
                        f"upload {chunk.upload} is not known here (the service restarted?); restart it from chunk 0"
                    ),
                )
            try:
                up = self.uploads[chunk.upload] = Upload(chunk0=chunk, sink=await self.open_sink(chunk, msg.subject))
            except Exception as e:
                failure = (
                    Failure(str(e))
                    if isinstance(e, Refused)
                    else _retry(f"the upload could not begin ({type(e).__name__}: {e})")
                )
                self.failed[chunk.upload] = failure
                return await self._reply(msg, chunk, failure)
            log.info("upload %s: %s begins", chunk.upload, up.sink.what)
        up.touched = time.monotonic()
        if chunk.seq < up.expected:
            return await self._reply(msg, chunk)  # a duplicate (redelivery): already taken
        if chunk.seq > up.expected:
            if chunk.seq - up.expected > MAX_AHEAD or chunk.seq in up.ahead:
                lost = _retry(f"chunk {up.expected} never arrived (got {chunk.seq})")
                return await self._fail_reply(up, msg, chunk, lost)
            if over := self._over_ahead_limit(up, len(chunk.data)):
                return await self._fail_reply(up, msg, chunk, _retry(over))
            up.ahead[chunk.seq] = (chunk, msg)
            up.ahead_bytes += len(chunk.data)
            self.ahead_bytes += len(chunk.data)
            return
        await self._take(up, chunk, msg)
        while up.expected in up.ahead and up.failed is None:
            await self._take(up, *self._release(up, up.expected))

    def _over_ahead_limit(self, up: Upload[C], size: int) -> str:
        """Why `size` more bytes out of order is too much (or ''): memory is bounded whatever senders do."""
        if up.ahead_bytes + size > self.ahead_limit:
            return (
                f"chunk {up.expected} never arrived and the chunks after it exceed the {self.ahead_limit >> 20} MiB "
                "one upload may hold out of order; send fewer chunks ahead (a smaller window)"
            )
        if self.ahead_bytes + size > self.ahead_total_limit:
            return (
                f"the service holds {self.ahead_bytes >> 20} MiB of chunks out of order for all uploads, its limit is "
                f"{self.ahead_total_limit >> 20} MiB; retry the upload"
            )
        return ""

    def _release(self, up: Upload[C], seq: int) -> tuple:
        chunk, msg = up.ahead.pop(seq)
        up.ahead_bytes -= len(chunk.data)
        self.ahead_bytes -= len(chunk.data)
        return chunk, msg

    async def _take(self, up: Upload[C], chunk, msg) -> None:
        up.expected += 1
        up.size += len(chunk.data)
        up.digest.update(chunk.data)
        try:
            up.sink.check(chunk.data)
            await up.sink.writer.write(chunk.data)
        except Refused as e:
            return await self._fail_reply(up, msg, chunk, str(e))
        except Exception as e:
            return await self._fail_reply(up, msg, chunk, _retry(f"the object store refused a chunk: {e}"))
        if not chunk.last:
            return await self._reply(msg, chunk)
        sha = up.digest.hexdigest()
        if chunk.size != up.size or chunk.sha256 != sha:
            return await self._fail_reply(
                up,
                msg,
                chunk,
                f"checksum mismatch: the sender says {chunk.size} bytes sha256 "
                f"{chunk.sha256[:12]}…, {up.size} bytes sha256 {sha[:12]}… arrived",
            )
        try:
            stored = await up.sink.commit(sha, up.digest.digest())
        except Refused as e:
            return await self._fail_reply(up, msg, chunk, str(e))
        except Exception as e:
            return await self._fail_reply(up, msg, chunk, _retry(f"the object store refused the upload: {e}"))
        del self.uploads[chunk.upload]
        self.stored += 1
        log.info("upload %s: stored %s (%d bytes)", chunk.upload, up.sink.what, up.size)
        await self._reply(msg, chunk, stored=stored)

    def fail(self, up: Upload[C], why: str | Failure) -> None:
        """End an upload: its chunks are purged, and its late chunks are told why."""
        if up.failed is not None:
            return
        up.failed = failure = why if isinstance(why, Failure) else Failure(why)
        up.held = [self._release(up, seq) for seq in list(up.ahead)]  # their memory goes back now
        up.aborted = aborted = asyncio.ensure_future(up.sink.writer.abort())
        self._aborts.add(aborted)
        aborted.add_done_callback(self._aborts.discard)
        self.uploads.pop(up.chunk0.upload, None)
        self.failed[up.chunk0.upload] = failure
        log.warning("upload %s of %s failed: %s; nothing was stored", up.chunk0.upload, up.sink.what, failure.reason)

    async def _fail_reply(self, up: Upload[C], msg, chunk, why: str | Failure) -> None:
        self.fail(up, why)
        failure = up.failed or Failure(str(why))
        try:
            if up.aborted is not None:
                await up.aborted  # its chunks are purged: no object appears
        except Exception as e:
            log.warning("upload %s: purging its chunks failed: %s", chunk.upload, e)
        await self._reply(msg, chunk, failure)
        held, up.held = up.held, []
        for c, m in held:
            await self._reply(m, c, failure)

    async def reap_stalled(self, stop: asyncio.Event) -> None:
        """Fail uploads whose sender went quiet, so their chunks do not linger in the store."""
        while not await sleep_unless_stopped(stop, min(1.0, self.stall_timeout / 4)):
            now = time.monotonic()
            for up in list(self.uploads.values()):
                if now - up.touched > self.stall_timeout:
                    self.fail(
                        up,
                        _retry(
                            f"upload stalled at chunk {up.expected} for {self.stall_timeout:.0f}s "
                            "(the sender went away); nothing was stored"
                        ),
                    )
            self.failed = {k: v for k, v in self.failed.items() if now - v.when < FAILED_KEPT_S}

    async def close(self) -> None:
        """Shutting down: every upload under way fails, and its chunks are purged before this returns."""
        for up in list(self.uploads.values()):
            self.fail(up, _retry("the service shut down mid-upload; the sender restarts it"))
        await asyncio.gather(*self._aborts, return_exceptions=True)
