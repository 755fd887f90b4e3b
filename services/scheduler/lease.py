"""One active scheduler at a time: a lease key in a KV bucket whose entries expire."""

from __future__ import annotations

import asyncio
import logging

from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

log = logging.getLogger(__name__)
LEASE_KEY = "scheduler"
LEASE_TTL_S = 3.0  # the lease bucket's max age: a dead leader's lease is gone this long after its last renewal


class Lease:
    """Take the lease with create(), keep it with update(last=revision); losing a race means standing by."""

    def __init__(self, kv: KeyValue, holder: str, ttl: float = LEASE_TTL_S) -> None:
        self.kv, self.holder, self.ttl = kv, holder, ttl
        self.revision = 0

    async def try_acquire(self) -> bool:
        try:
            self.revision = await self.kv.create(LEASE_KEY, self.holder.encode())
            return True
        except KeyWrongLastSequenceError:
            return False

    async def renew(self) -> bool:
        try:
            self.revision = await self.kv.update(LEASE_KEY, self.holder.encode(), last=self.revision)
            return True
        except KeyWrongLastSequenceError:
            return False

    async def holder_now(self) -> str | None:
        try:
            return (await self.kv.get(LEASE_KEY)).value.decode()
        except NotFoundError:
            return None

    async def release(self) -> None:
        try:
            await self.kv.delete(LEASE_KEY, last=self.revision)
        except Exception as e:  # another holder already: nothing of ours to release
            log.debug("lease release: %s", e)

    async def wait_for(self, stop: asyncio.Event) -> bool:
        """Stand by until the lease is ours (True) or stop is set (False)."""
        announced = False
        while not stop.is_set():
            if await self.try_acquire():
                return True
            if not announced:
                log.info("another scheduler (%s) holds the lease; standing by", await self.holder_now())
                announced = True
            try:
                await asyncio.wait_for(stop.wait(), self.ttl / 3)
            except asyncio.TimeoutError:
                pass
        return False
