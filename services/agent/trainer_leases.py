"""This node's holds on its jobs' trainer leases (the bucket's entries: schemas/trainer_lease.py): taken before a
trainer starts (waiting out another attempt's lease until it lapses or is let go), renewed at each heartbeat by
compare-and-set, let go when the attempt ends. The fence that keeps one trainer of a job computing at a time does
not depend on when the scheduler hears this node, on the scheduler's settings, or on this agent running at all."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas import names, trainer_lease
from schemas.trainer_lease import Holder

log = logging.getLogger(__name__)
POLL_S = 0.1  # how often a waiting attempt reads the entry it waits on
REQUEST_S = 2.0  # a read or write of the bucket not answered in this long counts as not done
MARGIN_S = 0.1  # beyond the holder's lease_s: its clock and ours may differ in rate, its step may be under way

Key = tuple[str, int]  # (job, attempt), as the agent holds its runs


class Superseded(Exception):
    """A newer attempt of the job holds its trainer lease: this one must not start."""


class TrainerLeases:
    """The entries this agent holds, by (job, attempt), with the revision each was last written at."""

    def __init__(self, js, node: str, connected: Callable[[], bool] = lambda: True) -> None:
        self.js, self.node = js, node
        self.connected = connected  # whether the bus is reachable now: a release does not wait on one that is not
        self.kv: KeyValue | None = None  # the bucket, once open; None: not open yet (see open)
        self.held: dict[Key, int] = {}
        self.unfenced: set[Key] = set()  # attempts whose trainer started while the bucket could not be opened
        self.unsure: set[Key] = set()  # attempts whose taking write was sent and not answered (it may be stored)
        self.taking: dict[Key, asyncio.Future] = {}  # taking writes on their way (a give-up does not cancel them)
        self.waits: dict[Key, asyncio.Future] = {}  # attempts waiting for the lease (take): give_up ends a wait
        self.said = False  # that the bucket cannot be opened (said once, loudly)

    async def open(self) -> None:
        """The bucket, made by the scheduler (ensure_resources). Without it (a scheduler of a release before it,
        or one that has not made it yet: agents may start first), an attempt's trainer is held by the heartbeat
        alone, as it was then, said loudly; each attempt that starts tries to open it again, so an agent started
        before the scheduler, or while JetStream did not answer, is not left without the fence for good."""
        if self.kv is not None:
            return
        try:
            self.kv = await asyncio.wait_for(self.js.key_value(names.TRAINER_LEASES_KV), REQUEST_S)
            if self.said:
                log.warning(
                    "the trainer lease bucket %s is open: attempts started from now on hold it", names.TRAINER_LEASES_KV
                )
        except Exception as e:  # not made yet (NotFoundError), JetStream not answering (a timeout, no responders)
            if self.said:
                return
            self.said = True
            log.warning(
                "the trainer lease bucket %s cannot be opened (%s): a job moved off this node while it was silent may "
                "be trained here and on its next node at once; start (or upgrade) the scheduler, which makes the bucket: "
                "each attempt that starts here tries to open it again",
                names.TRAINER_LEASES_KV,
                type(e).__name__,
            )

    def holder(self, job: str, attempt: int, lease_s: float) -> Holder:
        return Holder(job=job, attempt=attempt, node=self.node, lease_s=lease_s)

    async def take(
        self, job: str, attempt: int, lease_s: float, waiting: Callable[[Holder], Awaitable[None]]
    ) -> float | None:
        """acquire(), as a wait that give_up() ends at once (a cancel or pause of the attempt, which must not wait
        for another attempt's lease to be done): CancelledError then."""
        key = (job, attempt)
        wait = self.waits[key] = asyncio.ensure_future(self.acquire(job, attempt, lease_s, waiting))
        try:
            return await wait
        finally:
            if self.waits.get(key) is wait:
                del self.waits[key]

    def give_up(self, job: str, attempt: int) -> bool:
        """End the attempt's wait for the lease, if it waits (its take() raises CancelledError); whether it did."""
        wait = self.waits.get((job, attempt))
        if wait is None or wait.done():
            return False
        wait.cancel()
        return True

    async def acquire(
        self, job: str, attempt: int, lease_s: float, waiting: Callable[[Holder], Awaitable[None]]
    ) -> float | None:
        """Hold the job's lease for this attempt: at once when nobody holds it or an older attempt released it,
        else once its holder's lease has lapsed (the entry unchanged for the holder's lease_s since we first saw it
        so). `waiting` is told once who it waits for. The monotonic time the taking write was sent (the trainer may
        compute lease_s from it); None when the fence is off (the bucket still cannot be opened). Superseded when
        this attempt or a newer one holds it or released it."""
        await self.open()
        if self.kv is None:
            self.unfenced.add((job, attempt))
            return None
        mine, told = self.holder(job, attempt, lease_s), False
        seen: tuple[int, float] | None = None  # the holder's revision, and when we first saw it
        while True:
            sent = time.monotonic()
            try:
                entry = await self._entry(job)
                if entry is None:
                    await self._take(job, mine, 0)
                    return sent
                other = trainer_lease.decode(entry.value)
                _check_not_older(other, attempt)
                if other.released or (other.node, other.attempt) == (self.node, attempt):  # ended, or ours already
                    await self._take(job, mine, entry.revision)  # (ours: a write whose answer was lost)
                    return sent
                if seen is None or seen[0] != entry.revision:
                    seen = (entry.revision, time.monotonic())
                if time.monotonic() - seen[1] >= other.lease_s + MARGIN_S:
                    await self._take(job, mine, entry.revision)
                    log.warning(
                        "job %s: attempt %d on %s stopped renewing its trainer lease; attempt %d takes it here",
                        job,
                        other.attempt,
                        other.node,
                        attempt,
                    )
                    return sent
                if not told:
                    told = True
                    await waiting(other)
            except Superseded:
                raise
            except KeyWrongLastSequenceError:  # written by another at the same moment: read it again
                continue
            except Exception as e:  # the bus away: keep waiting, nothing is held meanwhile
                log.info("job %s: the trainer lease could not be read or written (%r); trying again", job, e)
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise asyncio.CancelledError  # a cancel that an await swallowed (3.11's wait_for): given up

            await asyncio.sleep(POLL_S)

    async def _take(self, job: str, mine: Holder, last: int) -> None:
        """Write our entry over revision `last` (0: there is none). A give-up meanwhile leaves the write going
        (release() waits for its answer); one that went unanswered may be stored (release() then looks)."""
        key = (job, mine.attempt)
        self.unsure.add(key)
        write = self.taking[key] = asyncio.ensure_future(self._write(job, mine, last=last, create=not last))
        try:
            self.held[key] = await asyncio.shield(write)
        except KeyWrongLastSequenceError:  # not written: another's write came first
            self.unsure.discard(key)
            raise
        finally:
            if write.done() and self.taking.get(key) is write:
                del self.taking[key]
        self.unsure.discard(key)

    def holds(self, job: str, attempt: int) -> bool:
        """Whether this attempt's trainer may compute as far as the bucket goes: the entry is ours (or the fence is
        off); False while it waits for another attempt's lease, and once it lost it."""
        return self.kv is None or (job, attempt) in self.held or (job, attempt) in self.unfenced

    async def renew(self, job: str, attempt: int, lease_s: float) -> bool | None:
        """Write our entry again over the revision we hold: True when it was (the trainer may go on lease_s from
        the moment the caller sent its heartbeat), False when another attempt took it over (ours must end now),
        None when it is not known now (the bus away, or not held yet)."""
        if self.kv is None or (job, attempt) in self.unfenced:
            return True  # no fence (it started without the bucket): the heartbeat alone decides
        last = self.held.get((job, attempt))
        if last is None:
            return None
        mine = self.holder(job, attempt, lease_s)
        try:
            written = await self._write(job, mine, last=last)
            if (job, attempt) in self.held:  # not released while this write was on its way (release() follows it)
                self.held[(job, attempt)] = written
            return True
        except KeyWrongLastSequenceError:
            pass
        except Exception as e:
            log.info("job %s: its trainer lease was not renewed (%r); its trainer waits until it is", job, e)
            return None
        try:  # our last write may have been stored without its answer reaching us: then the entry is still ours
            entry = await self._entry(job)
            if entry is not None and trainer_lease.decode(entry.value) == mine:
                self.held[(job, attempt)] = await self._write(job, mine, last=entry.revision)
                return True
        except Exception as e:
            log.info("job %s: its trainer lease could not be read (%r); its trainer waits until it is", job, e)
            return None
        self.held.pop((job, attempt), None)
        return False

    async def release(self, job: str, attempt: int) -> None:
        """Let go of the entry (the attempt's trainer is gone): written as released by this attempt, so the job's
        next attempt starts without waiting and an older one never does. One that cannot be let go now lapses by
        itself."""
        key = (job, attempt)
        self.unfenced.discard(key)
        write = self.taking.pop(key, None)  # given up while its taking write was on its way
        if self.kv is None or not (key in self.held or key in self.unsure or write is not None):
            return
        if not self.connected():  # the bus away (a shutdown may be under way): the entry lapses by itself
            self.forget(job, attempt)
            if write is not None:
                write.cancel()
            log.info("job %s: attempt %d's trainer lease lapses by itself (NATS not connected)", job, attempt)
            return
        if write is not None:
            try:
                self.held[key] = await write
                self.unsure.discard(key)
            except KeyWrongLastSequenceError:  # not written
                self.unsure.discard(key)
            except Exception:  # no answer: it may be stored (looked at below)
                pass
        last = self.held.pop(key, None)
        unsure = key in self.unsure
        self.unsure.discard(key)
        if last is None and not unsure:
            return
        done = Holder(job=job, attempt=attempt, node=self.node, lease_s=0.0, released=True)
        try:
            for _ in range(3):  # a renewal on its way (a heartbeat's) or a taking write unanswered: read, write again
                if last is None:
                    entry = await self._entry(job)
                    other = None if entry is None else trainer_lease.decode(entry.value)
                    if other is None or other.released or (other.node, other.attempt) != (self.node, attempt):
                        return  # not ours: nothing to let go
                    last = entry.revision
                try:
                    await self._write(job, done, last=last)
                    return
                except KeyWrongLastSequenceError:
                    last = None
            raise RuntimeError("the entry kept changing")
        except Exception as e:  # taken over, or the bus away: the next attempt waits out our lease
            log.info("job %s: attempt %d's trainer lease was not let go (%r); it lapses by itself", job, attempt, e)

    def forget(self, job: str, attempt: int) -> None:
        """Stop holding the entry without letting it go: its trainer may still compute (a co-training group's
        process drops a cancelled job at its next step boundary), so the job's next attempt waits out our lease."""
        self.unfenced.discard((job, attempt))
        self.unsure.discard((job, attempt))
        self.taking.pop((job, attempt), None)
        self.held.pop((job, attempt), None)

    async def _entry(self, job: str):
        assert self.kv is not None
        try:
            return await asyncio.wait_for(self.kv.get(trainer_lease.key(job)), REQUEST_S)
        except KeyNotFoundError:  # never written, gone with the bucket's max age, or deleted (an agent before releases)
            return None

    async def _write(self, job: str, holder: Holder, last: int = 0, create: bool = False) -> int:
        assert self.kv is not None
        key, value = trainer_lease.key(job), trainer_lease.encode(holder)
        write = self.kv.create(key, value) if create else self.kv.update(key, value, last=last)
        return await asyncio.wait_for(write, REQUEST_S)


def _check_not_older(other: Holder, attempt: int) -> None:
    """Superseded when the entry says a newer attempt holds the lease, or that this one or a newer one ended."""
    if other.attempt > attempt or (other.released and other.attempt == attempt):
        how = "released" if other.released else "holds"
        raise Superseded(f"attempt {other.attempt} of the job {how} its trainer lease (on {other.node})")


def waiting_words(other: Holder) -> str:
    """What an attempt waiting for another's lease reports."""
    return (
        f"waiting for attempt {other.attempt} of the job on {other.node} to stop before this one trains: its "
        f"trainer lease ends within {other.lease_s:.1f}s once not renewed, or when that attempt ends"
    )
