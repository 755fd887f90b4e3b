"""A model's record as the gateway that runs its calls keeps it (Owned), and its writes: over whatever another
gateway changed meanwhile (a deleted checkpoint), the model's next seq_id only once every call before it has its
outcome stored, and stopping the gateway's run of the model if another gateway took it over."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from schemas.tinker_store import FutureRecord, ModelRecord, model_key
from services.gateway.tinker.outcomes import Change
from services.gateway.tinker.store import Store
from services.gateway.tinker.trainers import Trainers


@dataclass
class Owned:
    """A model whose ordered calls this gateway runs."""

    record: ModelRecord
    revision: int
    arrived: dict[int, FutureRecord] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    changes: list[Change] = field(default_factory=list)  # made since the record was last written
    written_seq: int = 0
    finishing: dict[str, asyncio.Task] = field(default_factory=dict)  # outcomes stored while the next call runs
    running: int | None = None  # the seq_id running now
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)  # one write of the record at a time
    background: asyncio.Task | None = None  # a write while the calls go on
    task: asyncio.Task | None = None


class RecordWriter:
    def __init__(self, store: Store, gateway: str, trainers: Trainers) -> None:
        self.store, self.gateway, self.trainers = store, gateway, trainers

    def in_background(self, owned: Owned) -> None:
        """Write the record while the next calls run (a write that fails stops the pump at its next turn)."""
        owned.background = asyncio.create_task(self.write(owned))

    @staticmethod
    async def settle(owned: Owned) -> None:
        """Every outcome stored (before the record says their turns are past); one that failed stops the pump."""
        for task in list(owned.finishing.values()):
            await task

    async def write(self, owned: Owned) -> None:
        """The model's record as this gateway holds it, over whatever another gateway changed meanwhile (a deleted
        checkpoint); its next seq_id only once every call before it has its outcome stored. A record that names
        another gateway now means the model was taken over: stop."""
        async with owned.writing:
            record, seq, changes = owned.record, owned.record.next_seq, list(owned.changes)
            await self.settle(owned)  # the calls before `seq` (those after it are not counted as done)
            key = model_key(record.tenant, record.id)
            record.pump = self.gateway
            self.refresh(record, seq)
            snapshot = msgspec.structs.replace(record, next_seq=seq)
            revision = await self.store.update(self.store.kv, key, snapshot, owned.revision)
            if revision is None:
                revision = await self._merge(record, seq, changes)
            owned.revision, owned.written_seq = revision, seq
            del owned.changes[: len(changes)]

    def refresh(self, record: ModelRecord, seq: int) -> None:
        """The record takes what this gateway's route knows of the session's attempts, as of the calls before `seq`
        (their outcomes stored): the attempt trained on (ahead of them, as it is set before an answer is kept: a
        gateway after this one tells the loss of a call whose answer was never kept, and sends it again), and a
        loss to tell, kept until the call told it has its outcome stored (else the next gateway sends that call
        again, untold)."""
        route = self.trainers.routes.get(record.id)
        if route is None:
            return
        if route.telling is not None and route.telling[0] < seq:
            route.telling = None
        record.attempt = route.trained
        if route.telling is not None and not route.lost:  # told: the call told, alone, is told again
            record.lost_at, record.lost = route.telling
        else:
            record.lost_at, record.lost = None, route.lost

    async def _merge(self, record: ModelRecord, seq: int, changes: list[Change]) -> int:
        """Another gateway changed the stored record: this one's changes go on top of it, and this copy loses what
        the other deleted."""
        key, last = model_key(record.tenant, record.id), record.last_request

        def merge(stored: ModelRecord) -> bool:
            if stored.pump != self.gateway:
                raise TakenOver(record.id)
            stored.next_seq, stored.last_request = max(stored.next_seq, seq), max(stored.last_request, last)
            stored.job, stored.info = stored.job or record.job, stored.info or record.info
            stored.attempt, stored.lost, stored.lost_at = record.attempt, record.lost, record.lost_at
            for change in changes:
                change(stored)
            return True

        merged = await self.store.modify(self.store.kv, key, ModelRecord, merge)
        found = await self.store.get(self.store.kv, key, ModelRecord)
        if merged is None or found is None:
            raise TakenOver(record.id)
        stored, revision = found
        for name in set(record.saves) - set(stored.saves):
            record.saves.pop(name)
        for name in set(record.samplers) - set(stored.samplers):
            record.samplers.pop(name)
        return revision


class TakenOver(Exception):
    """Another gateway runs the model's calls now (this one was not heard of for a while)."""
