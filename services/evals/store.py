"""Every read and write the evals service makes of its KV bucket (names.EVALS_KV; a stored format:
schemas/evals.py), and the reading of a run's results from the object store."""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from schemas import names
from schemas.evals import ADMIN, DECODERS, RESULT_LINE, EvalDef, EvalRun, EvalSummary, ItemResult, eval_key, run_key
from services.kv_keys import kv_keys
from services.transfer.download import fetch_object, fetch_small

_enc = msgspec.json.Encoder()
CACHED_RUNS = 8  # runs whose per-item results are kept in memory for paging
CAS_TRIES = 16  # a run's update read and written again while other writers win the race


class Contended(Exception):
    """A run's record changed under every one of CAS_TRIES updates."""


class EvalStore:
    def __init__(self, js, kv) -> None:
        self.js, self.kv = js, kv
        self.items: OrderedDict[str, list[ItemResult]] = OrderedDict()

    async def _get(self, key: str):
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        return DECODERS[key.partition(".")[0]].decode(entry.value) if entry.value else None

    async def _all(self, kind: str, tenant: str | None, everyone: bool):
        """Every eval (or run) of the tenant; an admin's own (`_`), or every tenant's with `everyone`."""
        prefix = f"{kind}." if everyone else f"{kind}.{tenant or ADMIN}."
        keys = await kv_keys(self.kv, prefix)
        found = [await self._get(k) for k in sorted(keys)]
        return sorted((v for v in found if v is not None), key=lambda v: v.created)

    async def eval(self, tenant: str | None, name: str) -> EvalDef | None:
        return await self._get(eval_key(tenant, name))

    async def evals(self, tenant: str | None) -> list[EvalDef]:
        return await self._all("eval", tenant, everyone=False)

    async def put_eval(self, e: EvalDef) -> None:
        await self.kv.put(eval_key(e.tenant, e.name), _enc.encode(e))

    async def create_eval(self, e: EvalDef) -> bool:
        """False when an eval of that name exists already."""
        try:
            await self.kv.create(eval_key(e.tenant, e.name), _enc.encode(e))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def delete_eval(self, tenant: str | None, name: str) -> None:
        await self.kv.delete(eval_key(tenant, name))

    async def run(self, tenant: str | None, run: str) -> EvalRun | None:
        return await self._get(run_key(tenant, run))

    async def runs(self, tenant: str | None) -> list[EvalRun]:
        return await self._all("run", tenant, everyone=tenant is None)

    async def put_run(self, r: EvalRun) -> None:
        await self.kv.put(run_key(r.tenant, r.id), _enc.encode(r))

    async def update_run(self, tenant: str | None, run: str, change: Callable[[EvalRun], EvalRun | None]):
        """Compare-and-set: `change(current)` gives the new record (None: leave it as it is), written only over the
        revision it was made from; read and made again while another writer got there first. The record as
        stored after it; None when there is no such run (deleted)."""
        key = run_key(tenant, run)
        for _ in range(CAS_TRIES):
            try:
                entry = await self.kv.get(key)
            except KeyNotFoundError:
                return None
            if not entry.value:
                return None
            current = DECODERS["run"].decode(entry.value)
            new = change(current)
            if new is None:
                return current
            try:
                await self.kv.update(key, _enc.encode(new), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            return new
        raise Contended(f"eval run {run} kept changing under {CAS_TRIES} updates")

    async def delete_run(self, r: EvalRun) -> None:
        await self.kv.delete(run_key(r.tenant, r.id))
        self.items.pop(r.id, None)

    async def results(self, r: EvalRun) -> tuple[list[ItemResult], EvalSummary | None]:
        """A finished run's per-item results and summary, read from its `eval` artifact (kept for a few runs)."""
        if r.results is None or r.sha256 is None:
            return [], None
        if r.id in self.items:
            self.items.move_to_end(r.id)
            return self.items[r.id], r.summary
        data = await fetch_small(self.js, names.ARTIFACTS_BUCKET, r.results, r.sha256)
        if data is None:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "results.jsonl"
                await fetch_object(self.js, names.ARTIFACTS_BUCKET, r.results, path, r.sha256)
                data = path.read_bytes()
        lines = [RESULT_LINE.decode(line) for line in data.splitlines() if line.strip()]
        items = [line for line in lines if isinstance(line, ItemResult)]
        summary = next((line for line in lines if isinstance(line, EvalSummary)), None)
        self.items[r.id] = items
        while len(self.items) > CACHED_RUNS:
            self.items.popitem(last=False)
        return items, summary
