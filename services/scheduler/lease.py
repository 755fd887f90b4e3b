"""One active scheduler at a time: a lease key in a KV bucket whose entries expire."""

from __future__ import annotations

import asyncio
import logging

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from services.aio import sleep_unless_stopped
from services.bus import LEASE_TTL_S

log = logging.getLogger(__name__)
LEASE_KEY = "scheduler"


class Lease:
    """Take the lease with create(), keep it with update(last=revision); losing a race means standing by.

    Every call answers True or False: no error of the server's ends the scheduler that holds it."""

    def __init__(self, kv: KeyValue, holder: str, ttl: float = LEASE_TTL_S) -> None:
        self.kv, self.holder, self.ttl = kv, holder, ttl
        self.revision = 0
        self.contended_reads = 0  # creates whose follow-up read found the old lease already expired

    async def try_acquire(self) -> bool:
        try:
            self.revision = await self.kv.create(LEASE_KEY, self.holder.encode())
            return True
        except KeyWrongLastSequenceError:
            return False
        except KeyNotFoundError:
            # nats-py's create reads the key after a refused write; the old lease expired in between.
            # The key is free now: the next try takes it.
            self.contended_reads += 1
            log.debug("the lease expired while it was being taken; trying again")
            return False
        except Exception as e:  # server away or restarting: stand by and try again
            log.warning("could not try the scheduler lease (%s: %s); trying again", type(e).__name__, e)
            return False

    async def renew(self) -> bool:
        try:
            self.revision = await self.kv.update(LEASE_KEY, self.holder.encode(), last=self.revision)
            return True
        except KeyWrongLastSequenceError:
            return False

    async def holder_now(self) -> str | None:
        try:
            return ((await self.kv.get(LEASE_KEY)).value or b"").decode()
        except KeyNotFoundError:
            return None
        except Exception as e:
            log.debug("could not read the lease holder: %s", e)
            return None

    async def why_lost(self) -> str:
        """In words, for the log: who holds the lease now that our renewal was refused."""
        holder = await self.holder_now()
        if holder and holder != self.holder:
            return f"scheduler {holder} took the lease over"
        return (
            f"the lease lapsed: it was not renewed within {self.ttl:.0f}s (NATS unreachable or restarting?); "
            "taking it again"
        )

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
            if not announced and (holder := await self.holder_now()):
                log.info("another scheduler (%s) holds the lease; standing by", holder)
                announced = True
            await sleep_unless_stopped(stop, self.ttl / 3)
        return False
