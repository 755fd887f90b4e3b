"""Who runs a model's calls, and in what order. A training model's calls run one at a time in the order the client
numbered them (seq_id: a client sends a batch's chunks at once, the first last) on one gateway at a time: the one
named in the model's record (`pump`), while it is up. A gateway that takes a call for a model nobody runs takes the
model; one that takes a call for a model another gateway runs only stores it, and that gateway sees its key written
(mirror.py). A gateway that stops, or is not heard of for LIVE_S, leaves its models to the next gateway a client
calls. A seq_id that does not come within the gap timeout fails, and the calls after it run. Samples need no order
(at_once.py)."""

from __future__ import annotations

import asyncio
import logging
import time


from schemas.tinker_store import FutureRecord, ModelRecord, model_key, ordered_request
from services.gateway.tinker.at_once import AtOnce
from services.gateway.tinker.futures import Book, failed
from services.gateway.tinker.mirror import Mirror
from services.gateway.tinker.outcomes import Change, Runner
from services.gateway.tinker.owned import Owned, RecordWriter, TakenOver
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store

log = logging.getLogger(__name__)
LINGER_S = 60.0  # a model with no call this long is given back (any gateway takes it at its next call)
RESCAN_S = 5.0  # meanwhile its next call is looked for in the store this often (a write not heard of)
GIVE_BACK_S = 3.0  # a model's give-back at close, at most (they run at once)
WRITE_EVERY = 8  # a model's next seq_id is written at least this often while its calls run (and when they pause)


class Order:
    def __init__(
        self, store: Store, mirror: Mirror, book: Book, runner: Runner, gateway: str, settings: TinkerSettings
    ):
        self.store, self.mirror, self.book, self.runner = store, mirror, book, runner
        self.gateway, self.settings = gateway, settings
        self.owned: dict[str, Owned] = {}
        self.at_once = AtOnce(store, mirror, book, runner, gateway)
        self.writer = RecordWriter(store, gateway, runner.trainers)
        runner.trainers.keep = self._keep
        self._locks: dict[str, asyncio.Lock] = {}
        self._side: set[asyncio.Task] = set()  # short tasks beside the pumps (a fetch, a take-over)
        self.closing = False  # a pump ends at its next turn: a cancel alone may be swallowed on its way

    def _aside(self, work) -> None:
        task = asyncio.create_task(work)
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    def model(self, model_id: str) -> ModelRecord | None:
        """The record of a model whose calls run here (the freshest there is), else None: read the store."""
        owned = self.owned.get(model_id)
        return owned.record if owned is not None else None

    def change(self, model_id: str, change: Change) -> bool:
        """Change a model whose calls run here, in this gateway's copy and at its next write (False: not here)."""
        owned = self.owned.get(model_id)
        if owned is None:
            return False
        change(owned.record)
        owned.changes.append(change)
        owned.wake.set()
        return True

    # --- ordered calls --------------------------------------------------------------------------------------------
    def start_new(self, record: ModelRecord, revision: int, first: FutureRecord) -> None:
        """A model this gateway just made (its record names this gateway), and its create (seq 0)."""
        owned = self.owned[record.id] = Owned(record, revision, written_seq=record.next_seq)
        self.runner.trainers.took(record)
        self._arrive(owned, first)
        owned.task = asyncio.create_task(self._pump(owned))

    async def arrived(self, future: FutureRecord) -> None:
        """A call stored for its turn (or its turn taken at the door: it has its outcome already)."""
        owned = self.owned.get(future.model)
        if owned is not None:
            self._arrive(owned, future)
        else:
            await self.ensure(future.tenant, future.model)

    def _arrive(self, owned: Owned, future: FutureRecord) -> None:
        assert future.seq is not None
        fresh = future.seq not in owned.arrived and future.seq != owned.running
        if future.seq >= owned.record.next_seq and fresh:
            if future.outcome is None:
                self.book.expect(future)
            owned.arrived[future.seq] = future
            owned.wake.set()

    def written(self, tenant: str, request: str) -> None:
        """A call's key was written by some gateway: one for a model run here is fetched if it is not here yet."""
        self.book.written(request)
        model_id, _, seq = request.rpartition(":")
        owned = self.owned.get(model_id)
        if owned is None or not seq.isdigit() or int(seq) < owned.record.next_seq:
            return
        if int(seq) not in owned.arrived and int(seq) != owned.running:  # not its own write's echo
            self._aside(self._fetch(owned, tenant, request))  # short: one read; _fetch catches all

    async def _fetch(self, owned: Owned, tenant: str, request: str) -> None:
        try:
            future = await self.book.find(tenant, request)
            if future is not None and self.owned.get(owned.record.id) is owned:
                self._arrive(owned, future)
        except Exception as e:  # the next arrival or fetch of a client looks again
            log.warning("reading Tinker call %s failed: %s", request, e)

    async def ensure(self, tenant: str, model_id: str) -> None:
        """The model's calls run on a live gateway: this one takes the model if none does."""
        lock = self._locks.setdefault(model_id, asyncio.Lock())
        try:
            async with lock:
                if model_id in self.owned:
                    self.owned[model_id].wake.set()
                    return
                found = await self.store.get(self.store.kv, model_key(tenant, model_id), ModelRecord)
                if found is None:
                    return
                record, revision = found
                if record.pump and record.pump != self.gateway and self.mirror.alive(record.pump):
                    return
                record.pump = self.gateway
                written = await self.store.update(self.store.kv, model_key(tenant, model_id), record, revision)
                if written is None:  # another gateway took it at the same moment
                    return
                owned = self.owned[model_id] = Owned(record, written, written_seq=record.next_seq)
                self.runner.trainers.took(record)
                await self._scan(owned)
                owned.task = asyncio.create_task(self._pump(owned))
        finally:
            if not lock.locked() and not lock._waiters:  # type: ignore[attr-defined]
                self._locks.pop(model_id, None)

    async def _scan(self, owned: Owned) -> None:
        """The calls stored for the model from its next seq_id on (as far as the window reaches)."""
        record = owned.record
        seqs = range(record.next_seq, record.next_seq + self.settings.seq_window + 1)
        found = await asyncio.gather(*(self.book.find(record.tenant, ordered_request(record.id, s)) for s in seqs))
        for future in found:
            if future is not None:
                self._arrive(owned, future)

    async def _pump(self, owned: Owned) -> None:
        record, gap_since = owned.record, None
        try:
            while not self.closing:
                owned.wake.clear()
                _forget_past(owned)
                written = owned.background
                if written is not None and written.done():
                    owned.background = None
                    written.result()  # a write that failed: the model goes to the next gateway
                future = owned.arrived.pop(record.next_seq, None)
                if future is not None:
                    gap_since = None
                    if future.outcome is None:
                        owned.running = future.seq
                        await self._run(owned, future)
                        owned.running = None
                    else:
                        self.book.resolve(future.id, future.outcome)
                    record.next_seq += 1
                    record.last_request = time.time()
                    continue
                if owned.changes:
                    await self.writer.write(owned)
                elif record.next_seq - owned.written_seq >= WRITE_EVERY and not owned.writing.locked():
                    self.writer.in_background(owned)
                if owned.arrived:  # a later call came, this one not (yet): wait the gap timeout, then fail it
                    gap_since = gap_since or time.monotonic()
                    left = self.settings.gap_s - (time.monotonic() - gap_since)
                    if left <= 0:
                        await self._skip(owned, record.next_seq)
                        continue
                    await _wait(owned.wake, left)
                    continue
                if not await self._idle(owned) and await self._give_back(owned):
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # the store away: the model goes to the next gateway a client calls
            log.exception("running the calls of Tinker model %s stopped", record.id)
            self._drop(owned)

    async def _idle(self, owned: Owned) -> bool:
        """Wait for the model's next call up to LINGER_S (False: none came), looking in the store now and then
        for one whose key's write this gateway did not hear of."""
        deadline = time.monotonic() + LINGER_S
        while (left := deadline - time.monotonic()) > 0:
            if self.closing:  # its pump ends at its next turn, and the close gives the model back
                return True
            if await _wait(owned.wake, min(left, RESCAN_S if owned.record.next_seq == owned.written_seq else 0.2)):
                return True
            record = owned.record
            if record.next_seq != owned.written_seq:  # a pause in its calls: where they are is written now
                await self.writer.write(owned)
                continue
            future = await self.book.find(record.tenant, ordered_request(record.id, record.next_seq))
            if future is not None:
                self._arrive(owned, future)
                return True
        return bool(owned.arrived)

    async def _run(self, owned: Owned, future: FutureRecord) -> None:
        """Run the call; its outcome is stored while the next call runs (a gateway that dies meanwhile leaves both
        to the next, which sends them again under their call ids: a node answers a repeat, never runs it twice)."""
        outcome, changes = await self.runner.run(future, owned.record)
        if changes:  # what a save changed is seen by every gateway before the client hears of it
            owned.changes += changes
            await self.writer.write(owned)
        task = owned.finishing[future.id] = asyncio.create_task(self.book.finish(future, outcome))
        task.add_done_callback(lambda _: owned.finishing.pop(future.id, None))

    async def _skip(self, owned: Owned, seq: int) -> None:
        """The seq_id never came: it fails (a late one is told so) and the calls after it run."""
        record = owned.record
        message = (
            f"seq_id {seq} of model {record.id} did not arrive within {self.settings.gap_s:.0f} s of the calls after "
            "it; they ran without it (send calls with consecutive seq_ids)"
        )
        outcome = failed(message)
        skipped = FutureRecord(id=ordered_request(record.id, seq), tenant=record.tenant, model=record.id, seq=seq,
                               kind="skipped", created=time.time(), outcome=outcome)  # fmt: skip
        if await self.book.record(skipped) is None:  # it came at the last moment
            late = await self.book.find(record.tenant, skipped.id)
            if late is not None:
                self._arrive(owned, late)
                return
        log.info("model %s: %s", record.id, message)
        record.next_seq = max(record.next_seq, seq + 1)
        self.book.resolve(skipped.id, outcome)  # a late try of it taken here meanwhile: told it failed

    async def _give_back(self, owned: Owned) -> bool:
        """Nobody called for LINGER_S: the model is no longer run here (False: a call came meanwhile)."""
        async with owned.writing:
            await self.writer.settle(owned)
            self.writer.refresh(owned.record, owned.record.next_seq)
            owned.record.pump = ""
            key = model_key(owned.record.tenant, owned.record.id)
            given = await self.store.update(self.store.kv, key, owned.record, owned.revision) is not None
            owned.record.pump = "" if given else self.gateway
        if not given:  # another gateway changed it meanwhile (a deleted checkpoint): keep it, merged
            await self.writer.write(owned)
            return False
        self.owned.pop(owned.record.id, None)
        if owned.arrived:  # came while it was given back: take it again
            self._aside(self.ensure(owned.record.tenant, owned.record.id))
        return True

    async def _keep(self, model: ModelRecord) -> None:
        """The record of a model whose calls run here, written now with its route (Trainers.keep)."""
        owned = self.owned.get(model.id)
        if owned is None or owned.record is not model:
            raise TakenOver(model.id)
        await self.writer.write(owned)

    def _drop(self, owned: Owned) -> None:
        self.owned.pop(owned.record.id, None)
        if owned.running is not None:  # stopped in the middle (its record not written): the next gateway runs it
            self.book.abandon(ordered_request(owned.record.id, owned.running))
        if owned.background is not None:
            owned.background.cancel()
        for request, task in list(owned.finishing.items()):  # never stored: the next gateway runs them again
            task.cancel()
            self.book.abandon(request)
        for future in owned.arrived.values():
            self.book.abandon(future.id)

    async def revive(self, future: FutureRecord) -> None:
        """A fetch of a call not done yet: make sure a live gateway runs it (this one, if its own is gone)."""
        if future.seq is None:
            await self.at_once.revive(future, self.model(future.model))
            return
        await self.ensure(future.tenant, future.model)
        owned = self.owned.get(future.model)
        if owned is not None and future.seq >= owned.record.next_seq and future.seq not in owned.arrived:
            self._arrive(owned, future)

    async def close(self) -> None:
        """Stop running calls here, and give every model back at once (the next gateway goes on with them)."""
        self.closing = True  # (Python 3.11's wait_for returns a result that came with the cancel, dropping it)
        for owned in self.owned.values():
            owned.wake.set()
        await self.at_once.close()
        tasks = [o.task for o in self.owned.values() if o.task is not None] + list(self._side)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.store.nc.is_connected:  # the bus away: each goes to another gateway LIVE_S after this one's beat
            await asyncio.gather(*(self._give_back_at_close(o) for o in self.owned.values()))
        for owned in list(self.owned.values()):
            self._drop(owned)
        for request in list(self.book.local):
            self.book.abandon(request)

    async def _give_back_at_close(self, owned: Owned) -> None:
        """Its outcomes computed stored, then its record says no gateway runs it; all models at once, each within
        GIVE_BACK_S (a bus that goes away meanwhile must not hold the gateway's exit)."""

        async def give_back() -> None:
            await asyncio.gather(*owned.finishing.values(), return_exceptions=True)
            if owned.background is not None:
                await asyncio.gather(owned.background, return_exceptions=True)
            self.writer.refresh(owned.record, owned.record.next_seq)  # what the route knows since the last write
            owned.record.pump = ""
            key = model_key(owned.record.tenant, owned.record.id)
            await self.store.update(self.store.kv, key, owned.record, owned.revision)

        try:
            await asyncio.wait_for(give_back(), GIVE_BACK_S)
        except Exception as e:  # it goes to another gateway LIVE_S after this one's liveness record
            log.info("model %s not given back (%s)", owned.record.id, type(e).__name__ if not str(e) else e)


def _forget_past(owned: Owned) -> None:
    """Calls whose turn is past leave `arrived`: a skipped seq_id read back from the store while its skip was being
    written (its own write's echo) would otherwise stand for "a later call came" for ever, and every next seq_id
    would be failed as never come once the gap timeout passed."""
    for seq in [seq for seq in owned.arrived if seq < owned.record.next_seq]:
        del owned.arrived[seq]


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False
