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
from nats.js.errors import NotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.nuid import NUID

from schemas import names

_nuid = NUID()


class ObjectWriter:
    def __init__(
        self, js, bucket: str, name: str, description: str = "", headers: dict | None = None, window: int = 16
    ) -> None:
        self.js, self.bucket, self.name = js, bucket, name
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
        self.store = names.objects(bucket)
        self.subject = self.store.chunks(self.nuid)
        self.window = window
        self.pending: deque[asyncio.Future] = deque()

    async def write(self, data: bytes) -> None:
        """Publish one chunk; waits only when `window` chunks are still unacknowledged."""
        if not data:
            return
        self.pending.append(await self.js.publish_async(self.subject, data))
        self.size += len(data)
        self.chunks += 1
        self.max_chunk_size = max(self.max_chunk_size, len(data))  # what readers size their reads for
        while len(self.pending) >= self.window:
            await self.pending.popleft()

    async def _settle(self) -> None:
        while self.pending:
            await self.pending.popleft()

    async def commit(self, sha256: bytes) -> api.ObjectInfo:
        """Make the object visible (replacing one of the same name); raises if any chunk was not stored."""
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
        await self.js.publish(
            self.store.meta(self.name),
            json.dumps(self.info.as_dict()).encode(),
            headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT},
        )
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
