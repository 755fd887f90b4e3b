"""One active scheduler at a time: a lease key in a KV bucket whose entries expire, and a local deadline.

The key expires TTL after the server stored its last renewal. The holder counts from before it sent that renewal
(its monotonic clock) and stops leading after STEP_DOWN_FRACTION of the TTL: it has stopped before any standby
can take the key. A holder that stalls past that (a blocked loop, a paused VM) is still kept out by its term's
fence (services/scheduler/fence.py): its late writes are refused."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas.leadership import LEASE_KEY, LeaseRecord, decode_lease, encode_lease
from services.aio import sleep_unless_stopped
from services.bus import LEASE_TTL_S

log = logging.getLogger(__name__)
STEP_DOWN_FRACTION = 2 / 3  # of the TTL after the last successful renewal was sent
RENEWALS_PER_TTL = 6  # renewals are tried this often: several may fail before the deadline comes


@dataclass
class RenewalStats:
    """How late a busy loop let the renewals go out: each woke this long after it was due."""

    renewals: int = 0
    late: int = 0  # woke more than half an interval after it was due
    latest_s: float = 0.0

    def woke(self, late_s: float, interval: float) -> None:
        self.renewals += 1
        self.latest_s = max(self.latest_s, late_s)
        if late_s > interval / 2:
            self.late += 1
            if late_s > interval:
                log.warning(
                    "the scheduler's loop renewed its lease %.2fs late (it renews every %.2fs and steps down "
                    "%.1fs after the last renewal): something held the loop",
                    late_s,
                    interval,
                    interval * RENEWALS_PER_TTL * STEP_DOWN_FRACTION,
                )


class Lease:
    """Take the lease with create(), keep it with update(last=revision); losing a race means standing by.

    Every call answers True or False: no error of the server's ends the scheduler that holds it."""

    def __init__(self, kv: KeyValue, holder: str, ttl: float = LEASE_TTL_S) -> None:
        self.kv, self.holder, self.ttl = kv, holder, ttl
        self.term = 0  # the term this holder leads in, written with every renewal (agents read it)
        self.revision = 0
        self.renewed_at = float("-inf")  # monotonic: when the last renewal that succeeded was sent
        self.contended_reads = 0  # creates whose follow-up read found the old lease already expired

    @property
    def interval(self) -> float:
        """How often the holder renews."""
        return self.ttl / RENEWALS_PER_TTL

    @property
    def deadline(self) -> float:
        """Monotonic time at which the holder stops leading unless it renews first."""
        return self.renewed_at + self.ttl * STEP_DOWN_FRACTION

    def valid(self) -> bool:
        """Whether this holder may still act as the leader, by its own clock."""
        return time.monotonic() < self.deadline

    async def try_acquire(self) -> bool:
        """Take the free lease, or take back our own if nobody took it since we last held it (a holder that stepped
        down on its own clock after a stall leads again at once, instead of waiting out its own key)."""
        sent = time.monotonic()
        if self.revision:
            try:
                if await self.renew():
                    return True
            except Exception:
                pass
            self.revision = 0
        try:
            self.term = 0
            self.revision = await self.kv.create(LEASE_KEY, self._value())
            self.renewed_at = sent
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
        """True: renewed. False: the key is another's (or gone). Raises when the store did not answer in time
        (each try waits at most one renewal interval, so a hung request cannot outlive the deadline)."""
        sent = time.monotonic()
        try:
            self.revision = await asyncio.wait_for(
                self.kv.update(LEASE_KEY, self._value(), last=self.revision), self.interval
            )
        except KeyWrongLastSequenceError:
            return False
        self.renewed_at = sent
        return True

    def _value(self) -> bytes:
        return encode_lease(LeaseRecord(holder=self.holder, term=self.term))

    async def announce(self, term: int) -> None:
        """Write the term this holder now leads in into the lease, before it sends any node a command: a node that
        reads it refuses the commands of every older term. Raises when the lease is no longer ours."""
        self.term = term
        if not await self.renew():
            raise RuntimeError("the lease was taken over before the new term could be written into it")

    async def holder_now(self) -> str | None:
        try:
            return decode_lease((await self.kv.get(LEASE_KEY)).value or b"").holder
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
        self.renewed_at = float("-inf")
        try:
            await self.kv.delete(LEASE_KEY, last=self.revision)
        except Exception as e:  # another holder already: nothing of ours to release
            log.debug("lease release: %s", e)
        self.revision = 0

    async def wait_for(self, stop: asyncio.Event) -> bool:
        """Stand by until the lease is ours (True) or stop is set (False)."""
        announced = False
        while not stop.is_set():
            if await self.try_acquire():
                return True
            if not announced and (holder := await self.holder_now()):
                log.info("another scheduler (%s) holds the lease; standing by", holder)
                announced = True
            await sleep_unless_stopped(stop, self.interval)
        return False
