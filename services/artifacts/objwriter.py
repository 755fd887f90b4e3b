"""Write one object into a JetStream object store as chunks arrive: the store's own layout, pipelined acks.

This is what nats-py's ObjectStore.put does (chunks on `$O.<bucket>.C.<nuid>`, then the meta on
`$O.<bucket>.M.<name>` with a rollup), but fed by the caller chunk by chunk instead of pulling
from a reader, with up to `window` publishes awaiting their acks. The meta, which is what makes
the object visible, is published only by commit(); abort() purges the chunks written so far.
"""

from __future__ import annotations

from typing import Any

import asyncio
import base64
import json
from collections import deque
from datetime import datetime, timezone

from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.nuid import NUID

from schemas import nats_subjects
from services.jetstream_writer import EXPECTED_SEQUENCE, WRONG_LAST_SEQUENCE, JetStreamWriter

_nuid = NUID()
CHUNK_ACK_S = 10.0  # a chunk whose ack has not come by then fails its upload (the sender starts it again)


class ObjectChanged(Exception):
    """A conditional commit found the object's description changed since current() read it: nothing was made
    visible (the caller aborts, purging its chunks)."""


class ObjectWriter:
    def __init__(
        self,
        js,
        writer: JetStreamWriter,
        bucket: str,
        name: str,
        description: str = "",
        headers: dict | None = None,
        window: int = 16,
    ) -> None:
        self.js, self.writer, self.bucket, self.name = js, writer, bucket, name
        self.nuid = _nuid.next().decode()
        self.headers: dict[str, Any] = headers or {}  # what the object's meta will carry (callers may add to it)
        self.size = self.chunks = self.max_chunk_size = 0
        self.info = api.ObjectInfo(
            name=name,
            bucket=bucket,
            nuid=self.nuid,
            size=0,
            chunks=0,
            description=description,
            headers=self.headers,
            options=api.ObjectMetaOptions(max_chunk_size=0),
        )
        self.store = nats_subjects.objects(bucket)
        self.subject = self.store.chunks(self.nuid)
        self.window = window
        self.pending: deque[asyncio.Future] = deque()
        self.expect_sequence: int | None = None  # commit only if the description is still this one (0: none yet)

    async def current(self) -> tuple[api.ObjectInfo | None, int]:
        """The object as the store describes it now (None: no object, or a deleted one) and that description's
        stream sequence (0: never described), from one read: set `expect_sequence` to it and commit() makes the
        object visible only if nobody described it since, so of two writers of one name exactly one wins."""
        try:
            msg = await self.js.get_last_msg(self.store.stream, self.store.meta(self.name))
        except NotFoundError:
            return None, 0
        info = api.ObjectInfo.from_response(json.loads(msg.data))
        return (None if info.deleted else info), msg.seq

    async def write(self, data: bytes) -> None:
        """Publish one chunk; waits only when `window` chunks are still unacknowledged."""
        if not data:
            return
        self.pending.append(await self.writer.send(self.subject, data, None, CHUNK_ACK_S))
        self.size += len(data)
        self.chunks += 1
        self.max_chunk_size = max(self.max_chunk_size, len(data))  # what readers size their reads for
        while len(self.pending) >= self.window:
            JetStreamWriter.ack(await self.pending.popleft())  # a refusal or a lost ack fails the upload here

    async def _settle(self) -> None:
        while self.pending:
            JetStreamWriter.ack(await self.pending.popleft())

    async def commit(self, sha256: bytes) -> api.ObjectInfo:
        """Make the object visible (replacing one of the same name, unless `expect_sequence` says which
        description it may replace: ObjectChanged when another came first); raises if any chunk was not stored."""
        await self._settle()
        store = await self.js.object_store(self.bucket)
        try:
            old = await store.get_info(self.name)
        except NotFoundError:
            old = None
        self.info.size, self.info.chunks, self.info.headers = self.size, self.chunks, self.headers
        self.info.options = api.ObjectMetaOptions(max_chunk_size=self.max_chunk_size)
        self.info.mtime = datetime.now(timezone.utc).isoformat()
        self.info.digest = "SHA-256=" + base64.urlsafe_b64encode(sha256).decode()
        headers: dict[str, str] = {api.Header.ROLLUP: MSG_ROLLUP_SUBJECT}
        if self.expect_sequence is not None:
            headers[EXPECTED_SEQUENCE] = str(self.expect_sequence)
        try:
            await self.js.publish(self.store.meta(self.name), json.dumps(self.info.as_dict()).encode(), headers=headers)
        except BadRequestError as e:
            if e.err_code == WRONG_LAST_SEQUENCE:
                raise ObjectChanged(f"{self.name} was described by another writer since this one began") from None
            raise
        if old is not None and not old.deleted and old.nuid != self.nuid:
            await self.js.purge_stream(self.store.stream, subject=self.store.chunks(old.nuid))
        return self.info

    async def abort(self) -> None:
        """Forget the chunks written so far: no object appears."""
        for fut in self.pending:
            try:
                await fut
            except Exception:
                pass
        self.pending.clear()
        await self.js.purge_stream(self.store.stream, subject=self.subject)
