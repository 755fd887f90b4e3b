"""Eval runs through the engine that serves the name (schemas/engine_evals.py), what users of the name get: where a run
names a registered adapter at the version its name serves now, and some node's engine has it loaded (the registry's
node statuses, `loaded`), the evals service asks that node's agent, with a time-out, to answer and grade the run's
items there; it stores the results as a trainer-side run's `eval` artifact is stored (one JSON line an item, then the
summary with each grader's mean and 95% bootstrap interval) and finishes the run, saying which engine on which node
sampled it. Which path a run takes is route()'s. Where every node asked refuses or fails, the run goes to the trainer
(auto: `fallback`) or fails (--via engine), saying why. Each run asks in a task of its own (EngineRuns), so the
request that placed it is answered at once; a run whose asker is gone (its evals service stopped) is failed once its
reply could no longer come (expire())."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.js.api import ObjectMeta
from nats.js.errors import NotFoundError

from schemas import names
from schemas.artifacts import ArtifactMeta
from schemas.engine_evals import DEADLINE_S, REPLY_SLACK_S, EngineEvalReply, EngineEvalRequest, engine_via
from schemas.evals import SAMPLES, Criterion, EvalRun, EvalSummary, ItemResult, RunRequest, summarize
from schemas.jobs import DatasetRef, Error
from schemas.object_headers import artifact_headers, sha256_header
from schemas.registry import AdapterReply, NodeAdapterStatus
from services import bus
from services.evals.store import EvalStore
from services.evals.tasks import RunTasks
from services.transfer.datasets import visible_dataset

log = logging.getLogger(__name__)
ENDED = ("completed", "failed", "canceled")
Fallback = Callable[[EvalRun, str], Awaitable[None]]  # the run, and why no engine sampled it: to the trainer
_enc = msgspec.json.Encoder()


@dataclass
class Route:
    """Where a run samples: these nodes' engines, asked in turn (none: the trainer), and why that path."""

    nodes: list[NodeAdapterStatus]
    note: str


def route(q: RunRequest, adapter: str | None, version: int | None, found: AdapterReply | None) -> Route:
    """Through an engine that has adapter@version loaded where the name serves that version now (a canary node
    serving another is left out), unless the run asks for the trainer; else the trainer, saying why."""
    if q.via == "trainer":
        return Route([], "--via trainer asked for the trainer")
    if adapter is None or version is None or found is None:
        return Route([], "a base model is sampled by the trainer")
    alias = found.alias
    if alias.retired or alias.current != version:
        serves = "nothing" if alias.retired or alias.current is None else f"@{alias.current}"
        return Route([], f"{adapter}@{version} is not what {adapter} serves now ({serves}), so no engine serves it")
    nodes = [
        s for s in found.nodes if s.state == "loaded" and s.version == version and alias.serving(s.node) == version
    ]
    if not nodes:
        return Route([], f"no node's engine has {adapter}@{version} loaded")
    said = "--via engine asked for it" if q.via == "engine" else "auto: an engine serves it"
    return Route(sorted(nodes, key=lambda s: s.node), said)


async def pinned(js, dataset: str, tenant: str | None) -> DatasetRef | str:
    """The items' dataset as the tenant sees it, pinned to its content now (as the scheduler pins a job's); a
    string says why it cannot be."""
    found = await visible_dataset(js, dataset, tenant)
    if found is None:
        return f"no dataset named {dataset}; `jetlora datasets ls` lists them"
    if found.stats.format != "rft":
        return f"dataset {dataset} holds {found.stats.format} rows; an eval's items are rft rows"
    return DatasetRef(name=dataset, sha256=found.sha256, owner=found.owner)


class EngineRuns(RunTasks):
    """The engine runs this evals service asks for, by run id, each in its own task."""

    def __init__(self, nc: Client, store: EvalStore) -> None:
        super().__init__("asking its engine")
        self.nc, self.js, self.store = nc, nc.jetstream(), store

    def start(self, run: EvalRun, ask: EngineEvalRequest, nodes: list[NodeAdapterStatus], fallback: Fallback | None):
        self.spawn(run.id, self._run(run, ask, nodes, fallback))

    async def _run(self, run: EvalRun, ask: EngineEvalRequest, nodes, fallback: Fallback | None) -> None:
        """Ask each node in turn, within one deadline, until one answers; else fall back (or fail), saying why."""
        reasons: list[str] = []
        deadline = time.monotonic() + ask.deadline_s
        for s in nodes:
            left = deadline - time.monotonic()
            if left < 1.0:
                reasons.append(f"no time was left of its {ask.deadline_s:.0f}s to ask node {s.node}")
                break
            q = msgspec.structs.replace(ask, engine=s.engine, deadline_s=left)
            subject = names.node(s.node).evaluate
            try:
                reply = await bus.request(self.nc, subject, q, EngineEvalReply | Error, left + REPLY_SLACK_S)
            except bus.RequestError as e:
                reasons.append(f"node {s.node}'s agent did not answer ({e})")
                continue
            if isinstance(reply, Error):
                reasons.append(reply.error)
                continue
            try:
                await self._finish(run, reply, ask)
            except Exception as e:  # the object store away: the run must still end, saying so
                log.exception("eval run %s: its results could not be stored", run.id)
                await fail(self.store, run, f"its results could not be stored ({type(e).__name__}: {e}); run it again")
            return
        why = "; ".join(reasons)
        log.warning("eval run %s: no engine sampled it: %s", run.id, why)
        if fallback is not None:
            await fallback(run, f"no engine sampled it: {why}")
        else:
            await fail(self.store, run, f"--via engine: no engine sampled it: {why}")

    async def _finish(self, run: EvalRun, reply: EngineEvalReply, ask: EngineEvalRequest) -> None:
        items = sorted(reply.items, key=lambda r: r.index)
        via = engine_via(reply.engine, reply.node)
        said = f"{len(items)} items answered through {via} in {reply.seconds:.1f}s"
        await complete(self.js, self.store, run, items, ask.criteria, said, via=via)
        log.info("eval run %s: completed through %s", run.id, via)


async def complete(
    js, store: EvalStore, run: EvalRun, items: list[ItemResult], criteria: list[Criterion], message: str, **more
) -> None:
    """A run this service carried out, finished: its results stored (store_results) and the run completed with them
    and their summary; one that ended meanwhile (cancelled, deleted) stays as it is, and the results go."""
    summary = summarize(items, criteria)
    name, sha256 = await store_results(js, run, items, summary)
    changes = {"state": "completed", "message": message, "results": name, "sha256": sha256, "summary": summary, **more}

    def change(current: EvalRun) -> EvalRun | None:
        if current.state in ENDED:
            return None
        return msgspec.structs.replace(current, **changes, updated=time.time())

    stored = await store.update_run(run.tenant, run.id, change)
    if stored is None or stored.results != name:
        await drop_results(js, msgspec.structs.replace(run, results=name))


async def store_results(js, run: EvalRun, items: list[ItemResult], summary: EvalSummary) -> tuple[str, str]:
    """The results in the artifacts bucket as an eval job's `eval` artifact: (object name, sha256)."""
    data = b"".join(_enc.encode(line) + b"\n" for line in (*items, summary))
    sha256 = hashlib.sha256(data).hexdigest()
    name = names.artifact_name(run.id, "eval")
    meta = ArtifactMeta(base_model=run.base_model, tenant=run.tenant or "", filename=f"{run.id}-eval.jsonl")
    headers = artifact_headers(run.id, "eval", meta) | dict([sha256_header(sha256)])
    obs = await js.object_store(names.ARTIFACTS_BUCKET)
    await obs.put(name, data, meta=ObjectMeta(name=name, headers=headers))
    return name, sha256


async def drop_results(js, run: EvalRun) -> None:
    """An engine run's (or a run of samples') results, deleted with the run (a trainer-side run's are its job's,
    which retention keeps)."""
    if run.job or run.results is None:
        return
    try:
        await (await js.object_store(names.ARTIFACTS_BUCKET)).delete(run.results)
    except NotFoundError:
        pass


async def fail(store: EvalStore, run: EvalRun, why: str) -> None:
    def change(current: EvalRun) -> EvalRun | None:
        if current.state in ENDED:
            return None
        return msgspec.structs.replace(current, state="failed", message=why, updated=time.time())

    await store.update_run(run.tenant, run.id, change)


async def expire(store: EvalStore, run: EvalRun) -> EvalRun:
    """An engine run or a run of samples (no job) still unfinished after its asker's deadline could have ended:
    failed, saying so."""
    if run.job or run.state in ENDED or time.time() - run.updated < DEADLINE_S + 2 * REPLY_SLACK_S:
        return run
    what = "its grading never ended" if run.via == SAMPLES else "its engine's answer never came"
    why = f"{what} (the evals service that ran it stopped meanwhile?); run it again"
    await fail(store, run, why)
    return await store.run(run.tenant, run.id) or run
