"""A reader that nats-py's ObjectStore.put pulls from (in a thread) while chunk messages push into it."""

from __future__ import annotations

import asyncio

EOF_MARK = object()


class UploadFailed(Exception):
    """Raised inside ObjectStore.put so it purges what it wrote: the object never appears."""


class ChunkPipe:
    """Bounded: feed() waits while `depth` chunks are unread, so memory stays at a few chunks."""

    def __init__(self, loop: asyncio.AbstractEventLoop, depth: int = 4) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=depth)
        self.buf = memoryview(b"")

    async def feed(self, data: bytes) -> None:
        if data:
            await self.queue.put(data)

    async def finish(self) -> None:
        await self.queue.put(EOF_MARK)

    def fail(self, reason: str) -> None:
        """Make the reader raise at once, whatever it had not read yet."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(UploadFailed(reason))

    def readinto(self, b) -> int:  # called by ObjectStore.put in an executor thread
        while not self.buf:
            item = asyncio.run_coroutine_threadsafe(self.queue.get(), self.loop).result()
            if item is EOF_MARK:
                return 0
            if isinstance(item, Exception):
                raise item
            self.buf = memoryview(item)
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n
