"""The Tinker API's sessions as the dashboard shows them: read from the gateways' stored records (names.TINKER_KV and
names.TINKER_FUTURES_KV, in schemas/tinker_store.py's format), each bucket followed by one long-lived consumer, and
summed up per session: its state, its models and their calls. The dashboard never asks a gateway (there may be none
running, or several): what the store holds is what every gateway serves."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
from msgspec import Struct, field

from schemas import names
from schemas.sessions import ForwardBackward, LoadWeights, OptimStep, Sample, SaveWeights, SessionCall
from schemas.tinker_store import FutureRecord, GatewayRecord, ModelRecord, SamplerRecord, SessionRecord
from services.store_views import kv_view
from services.streamview import LatestView

SESSIONS_SHOWN = 50  # the newest; the panel says how many there are in all
CALLS_SHOWN = 8  # a model's latest calls, besides its counts
CATCH_UP_S = 2.0  # a read of the store waits this long for the views to reach what the stream holds

_RECORDS: dict[str, msgspec.json.Decoder] = {
    "gateway": msgspec.json.Decoder(GatewayRecord),
    "session": msgspec.json.Decoder(SessionRecord),
    "model": msgspec.json.Decoder(ModelRecord),
    "sampler": msgspec.json.Decoder(SamplerRecord),
}
_FUTURE = msgspec.json.Decoder(FutureRecord)
CallState = Literal["pending", "done", "failed"]


class CallRow(Struct, kw_only=True):
    """One call of a model (a future), as the panel lists it."""

    id: str
    model: str
    seq: int | None  # its turn in the model's order; None: a sample, run at once
    kind: str
    what: str  # the call in a few words: "forward_backward cross_entropy, 8 sequences"
    state: CallState
    error: str = ""
    created: float = 0.0


class ModelRow(Struct, kw_only=True):
    id: str
    kind: str  # "train", or "base" (a base model's sampler)
    base_model: str
    job: str  # its session job: the jobs table's row
    calls: int
    pending: int
    failed: int
    latest: list[CallRow]  # newest first
    saves: list[str] = field(default_factory=list)  # save_state names, then sampler saves
    last_request: float = 0.0


class SessionRow(Struct, kw_only=True):
    id: str
    tenant: str
    state: Literal["active", "paused", "finished"]
    created: float
    heard: float  # its client's last heartbeat
    models: list[ModelRow]
    samplers: int


class TinkerPanel(Struct, kw_only=True):
    sessions: list[SessionRow]  # the newest SESSIONS_SHOWN
    total: int  # sessions in the store
    gateways: list[str]  # the gateways that recorded themselves up
    now: float


def _record(key: str, data: bytes) -> Any:
    kind = key.partition(".")[0]
    return _RECORDS[kind].decode(data) if kind in _RECORDS else None


KINDS = {  # a call whose body is gone (done: the gateway keeps only its outcome) by its kind, in Tinker's words
    "create": "create model",
    "create_from_state": "create model from a saved state",
    "forward": "forward or forward_backward",
    "optim": "optim_step",
    "save_state": "save_state",
    "save_sampler": "save_weights_for_sampler",
    "load": "load_state",
    "sample": "sample",
}


class Calls:
    """Decodes the futures bucket's values into rows. A call is described from its body while it is pending; the
    gateway drops the body once the outcome is stored, so the description is kept until then (as many as are
    pending: the gateway bounds them per tenant)."""

    def __init__(self) -> None:
        self.described: dict[str, str] = {}

    def __call__(self, key: str, data: bytes) -> CallRow | None:
        future = _FUTURE.decode(data)
        outcome = future.outcome
        error = outcome.json.get("error", "") if outcome is not None and isinstance(outcome.json, dict) else ""
        state: CallState = "pending" if outcome is None else "failed" if error else "done"
        what = describe(future.call, future.kind) if future.call is not None else None
        if outcome is None and what is not None:
            self.described[future.id] = what
        elif outcome is not None:
            what = self.described.pop(future.id, None) or what
        return CallRow(
            id=future.id,
            model=future.model,
            seq=future.seq,
            kind=future.kind,
            what=what or KINDS.get(future.kind, future.kind),
            state=state,
            error=str(error),
            created=future.created,
        )


def describe(call: SessionCall, kind: str) -> str:
    """A call in a few words."""
    if isinstance(call, ForwardBackward):
        verb = "forward" if call.forward_only else "forward_backward"
        return f"{verb} {call.loss_fn}, {len(call.data)} sequences"
    if isinstance(call, OptimStep):
        return f"optim_step lr {call.learning_rate:g}"
    if isinstance(call, SaveWeights):
        return f"save {call.kind} {call.name}"
    if isinstance(call, LoadWeights):
        return f"load {call.name}" + (" with its optimizer" if call.optimizer else "")
    if isinstance(call, Sample):
        return f"sample {call.num_samples} x {call.max_tokens} tokens" + (
            f" from {call.weights}" if call.weights else ""
        )
    return KINDS.get(kind, kind)


class TinkerView:
    """Both buckets, each held current by a LatestView; `panel()` reads them as of the request."""

    def __init__(self, js) -> None:
        self.records: LatestView = kv_view(js, names.TINKER_KV, _record, catch_up_s=CATCH_UP_S)
        self.calls: LatestView = kv_view(js, names.TINKER_FUTURES_KV, Calls(), catch_up_s=CATCH_UP_S)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow both buckets until `stop` (each view replaces a broken consumer itself, loudly)."""
        await asyncio.gather(self.records.run(stop), self.calls.run(stop))

    async def panel(self) -> TinkerPanel:
        """The panel as of now; StaleView when the store cannot be read in CATCH_UP_S (say, no bucket yet)."""
        records, calls = await asyncio.gather(self.records.snapshot(), self.calls.snapshot())
        return summarize(records, calls, time.time())


def summarize(records: Mapping[str, Any], calls: Mapping[str, CallRow], now: float) -> TinkerPanel:
    """The sessions, newest first, with their models and each model's calls."""
    by_model: dict[str, list[CallRow]] = defaultdict(list)
    for row in calls.values():
        by_model[row.model].append(row)
    models = {v.id: v for v in records.values() if isinstance(v, ModelRecord)}
    of_session: dict[tuple[str, str], list[ModelRecord]] = defaultdict(list)
    for m in models.values():
        of_session[(m.tenant, m.session)].append(m)
    samplers: dict[tuple[str, str], int] = defaultdict(int)
    for v in records.values():
        if isinstance(v, SamplerRecord) and v.model in models:
            samplers[(v.tenant, models[v.model].session)] += 1
    sessions = [v for v in records.values() if isinstance(v, SessionRecord)]
    gateways = [v.id for v in records.values() if isinstance(v, GatewayRecord)]
    sessions.sort(key=lambda s: s.created, reverse=True)
    rows = [
        SessionRow(
            id=s.id,
            tenant=s.tenant,
            state="finished" if s.finished is not None else "paused" if s.paused else "active",
            created=s.created,
            heard=s.heard,
            models=[_model_row(m, by_model.get(m.id, [])) for m in sorted(of_session[(s.tenant, s.id)], key=_made)],
            samplers=samplers[(s.tenant, s.id)],
        )
        for s in sessions[:SESSIONS_SHOWN]
    ]
    return TinkerPanel(sessions=rows, total=len(sessions), gateways=sorted(gateways), now=now)


def _made(m: ModelRecord) -> float:
    return m.created


def _model_row(m: ModelRecord, calls: list[CallRow]) -> ModelRow:
    calls = sorted(calls, key=lambda c: c.created, reverse=True)
    return ModelRow(
        id=m.id,
        kind=m.kind,
        base_model=m.base_model,
        job=m.job,
        calls=len(calls),
        pending=sum(c.state == "pending" for c in calls),
        failed=sum(c.state == "failed" for c in calls),
        latest=calls[:CALLS_SHOWN],
        saves=[*m.saves, *m.samplers],
        last_request=m.last_request,
    )
