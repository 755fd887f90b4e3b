"""Running one stored call: a create submits the model's session job and waits until its trainer answers; any other
call goes to the trainer (trainers.py), and the session's reply becomes the client's answer together with what the
model's record keeps of it (a save's name and step, a sampling session). A call's failure is its outcome; one that
nobody foresaw is logged with its traceback and answered as the gateway's fault, naming the request."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from schemas.sessions import (
    SNAPSHOTS_KEPT,
    ForwardResult,
    LoadedResult,
    Ping,
    PingResult,
    SampleResult,
    SavedResult,
    StepResult,
)
from schemas.tinker_store import FutureRecord, ModelRecord, Outcome, SamplerRecord, SaveRecord, sampler_key
from services.gateway.tinker import proto
from services.gateway.tinker.futures import Book, CallFailed, failed
from services.gateway.tinker.paths import answered, tinker_path
from services.gateway.tinker.saves import Saves
from services.gateway.tinker.store import Store
from services.gateway.tinker.trainers import NotKept, Trainers

log = logging.getLogger(__name__)
# optim_step's metrics, named as Tinker names metrics (name:how chunks combine), never a bare `step`: a loop merges
# them into its own metrics row, whose `step` column the cookbook's resume reads.
STEP_METRIC, NORM_METRIC = "optimizer_step:unique", "grad_norm:mean"
Change = Callable[[ModelRecord], object]  # what a call changed in its model's record, replayed on the stored one


class Runner:
    def __init__(self, store: Store, book: Book, trainers: Trainers, saves: Saves) -> None:
        self.store, self.book, self.trainers, self.saves = store, book, trainers, saves

    async def run(self, future: FutureRecord, model: ModelRecord) -> tuple[Outcome, list[Change]]:
        """The call's outcome, and the changes it made to `model` (already made to this copy of it)."""
        changes: list[Change] = []
        try:
            if future.kind in ("create", "create_from_state"):
                return await self._create(future, model, changes), changes
            call = await self.book.call_of(future)
            if call is None:
                raise CallFailed("this call's body is no longer kept (calls are kept a day); send it again", "server")
            reply = await self.trainers.send(model, call, future.call_id, future.seq)
            return await CONVERT[future.kind](self, future, model, reply, changes), changes
        except CallFailed as e:
            return failed(str(e), e.category), changes
        except NotKept:  # its answer must not be kept either: the next gateway sends it again
            raise
        except Exception as e:  # a fault of the gateway's own: the client is told which request, the log says why
            log.exception("Tinker call %s (%s) of model %s failed in the gateway", future.id, future.kind, model.id)
            return failed(
                f"the gateway failed on this call ({type(e).__name__}: {e}); request {future.id}", "server"
            ), changes

    async def _create(self, future: FutureRecord, model: ModelRecord, changes: list[Change]) -> Outcome:
        args = future.args
        if future.kind == "create_from_state":
            await self.trainers.stored(model.tenant, args["source_job"], args["step"])
        if not model.job:
            if future.job is None:
                raise CallFailed(f"model {model.id} has no session job to start", "server")
            job = await self.trainers.submit(model.tenant, future.job)  # sent again: the same job (its key)
            _change(model, changes, lambda m: setattr(m, "job", job))
        info = await self.trainers.send(model, Ping(), future.call_id)
        if not isinstance(info, PingResult):
            raise CallFailed(f"model {model.id}'s session did not start: {getattr(info, 'message', info)}")
        _change(model, changes, lambda m: setattr(m, "info", info))
        if future.kind == "create_from_state":
            return Outcome(json={"model_id": model.id, "path": args["path"], "type": "load_weights"})
        return Outcome(json={"model_id": model.id, "type": "create_model"})

    async def _forward(self, future, model, reply, changes) -> Outcome:
        return Outcome(body=proto.forward_output(answered(reply, ForwardResult)))

    async def _optim(self, future, model, reply, changes) -> Outcome:
        step = answered(reply, StepResult)
        metrics = {STEP_METRIC: float(step.step)} | ({} if step.grad_norm is None else {NORM_METRIC: step.grad_norm})
        return Outcome(json={"metrics": metrics})

    async def _save_state(self, future, model, reply, changes) -> Outcome:
        saved = answered(reply, SavedResult)
        record = SaveRecord(step=saved.step, time=time.time(), expires=future.args.get("expires"))
        _change(model, changes, lambda m: m.saves.__setitem__(saved.name, record))
        return Outcome(json={"path": tinker_path(model.id, "weights", saved.name)})

    async def _save_sampler(self, future, model, reply, changes) -> Outcome:
        saved = answered(reply, SavedResult)
        path = tinker_path(model.id, "sampler_weights", saved.name)
        if future.args.get("named"):  # in the object store (the node put it there): a record of its own
            await self.saves.record(model, saved, future.args.get("expires"))
            return Outcome(json={"path": path})
        record = SaveRecord(step=saved.step, time=time.time(), expires=future.args.get("expires"))
        sampler_id = f"{model.id}:sample:{saved.name}"
        sampler = SamplerRecord(id=sampler_id, tenant=model.tenant, model=model.id, weights=saved.name,
                                base_model=model.base_model, model_path=path, created=time.time())  # fmt: skip
        await self.store.put(self.store.kv, sampler_key(model.tenant, sampler_id), sampler)
        unnamed = [n for n in model.samplers if n.startswith("snapshot-") and n != saved.name]
        dropped = unnamed[: max(0, len(unnamed) + 1 - SNAPSHOTS_KEPT)] if saved.name.startswith("snapshot-") else []

        def keep(m: ModelRecord) -> None:  # the trainer keeps the last SNAPSHOTS_KEPT unnamed ones, as here
            m.samplers[saved.name] = record
            for name in dropped:
                m.samplers.pop(name, None)

        _change(model, changes, keep)
        for name in dropped:
            await self.store.delete(self.store.kv, sampler_key(model.tenant, f"{model.id}:sample:{name}"))
        return Outcome(json={"path": path, "sampling_session_id": sampler_id})

    async def _save_external(self, future, model, reply, changes) -> Outcome:
        """An export (save_weights_external): stored by the node as a sampler save is, listed as external weights."""
        saved = answered(reply, SavedResult)
        path = future.args["path"]
        save = await self.saves.record(
            model, saved, future.args.get("expires"), path, tuple(future.args.get("age") or ())
        )
        return Outcome(json={"path": path, "size_bytes": save.size, "type": "save_weights_external"})

    async def _load(self, future, model, reply, changes) -> Outcome:
        loaded = answered(reply, LoadedResult)
        return Outcome(json={"path": future.args["path"], "model_id": model.id, "step": loaded.step})

    async def _sample(self, future, model, reply, changes) -> Outcome:
        return Outcome(body=proto.sample_output(answered(reply, SampleResult)))

    async def _sample_text(self, future, model, reply, changes) -> Outcome:
        """A sample the OpenAI-compatible routes asked in text: the session's result as JSON (texts included)."""
        return Outcome(json=msgspec.to_builtins(answered(reply, SampleResult)))


def _change(model: ModelRecord, changes: list[Change], change: Change) -> None:
    change(model)
    changes.append(change)


CONVERT = {
    "forward": Runner._forward,
    "optim": Runner._optim,
    "save_state": Runner._save_state,
    "save_sampler": Runner._save_sampler,
    "save_external": Runner._save_external,
    "load": Runner._load,
    "sample": Runner._sample,
    "sample_text": Runner._sample_text,
}
KINDS = ("create", "create_from_state", *CONVERT)
