"""Eval runs through this node's engines (schemas/engine_evals.py): the evals service asks on
jetlora.node.<node>.evaluate for a run's items to be answered through an engine of this node that serves
adapter@version under that name (what the name's users get), graded here as a gated canary's served eval is graded
(evals/served.py: the same chat completions and sampling, the same graders, python graders in the sandbox), and the
per-item results sent back. Each request is answered in a task of its own, RUNS_AT_ONCE at most at once, all within
the request's deadline on this node's clock. What this node cannot do (no engine of its serves that version, the
dataset cannot be read, a grader it may not run, an engine that fails, results too large for one message) is an
Error saying why: the evals service then samples through the trainer, or fails the run where the engine was forced."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.js.errors import NotFoundError
from nats.micro.service import Group

from schemas import names
from schemas.dataset_check import UTF8_BOM
from schemas.datasets import RftRow
from schemas.engine_evals import EngineEvalReply, EngineEvalRequest
from schemas.evals import ItemResult
from schemas.jobs import Error
from services import bus
from services.agent.engines import Engine
from services.agent.evals.served import EvalFailed, answers, fetched, grade, runnable
from services.aio import cancel_and_wait
from services.transfer.download import DownloadError

log = logging.getLogger(__name__)
RUNS_AT_ONCE = 2  # eval runs answered at once by this node (each asks its engine CONCURRENCY completions at once)
_rows, _fields = msgspec.json.Decoder(RftRow), msgspec.json.Decoder(dict)


class EvalRuns:
    """Answers this node's eval runs through the deployment's engines (its node, js, engines, served state, http and
    graders context)."""

    def __init__(self, deployment) -> None:
        self.deployment = deployment
        self.turns = asyncio.Semaphore(RUNS_AT_ONCE)
        self.tasks: set[asyncio.Task] = set()
        self.reply = bus.handler(self.answer, EngineEvalRequest)
        self.closed = False

    async def serve(self, group: Group) -> None:
        """Answer this node's eval runs (names.node(node).evaluate) as an endpoint of the agent's service, until
        close()."""
        await bus.add_endpoint(group, "agent-evaluate", self._on_message, "evaluate")

    async def _on_message(self, msg) -> None:
        if self.closed:  # the engines are followed no more (the agent is shutting down): refused at once
            await self.reply(msg)
            return
        task = asyncio.ensure_future(self.reply(msg))  # a run takes minutes: the next request is not held up
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        """Refuse the runs asked from now on; end those under way."""
        self.closed = True
        await cancel_and_wait(list(self.tasks))

    async def answer(self, q: EngineEvalRequest) -> EngineEvalReply | Error:
        """The run's items answered and graded through an engine here, or an Error saying why not."""
        node, started = self.deployment.node, time.monotonic()
        if self.closed:
            return Error(f"node {node} is shutting down: its engines answer no eval run now", "via")
        try:
            async with asyncio.timeout(q.deadline_s):
                async with self.turns:
                    engine, results = await self._evaluate(q)
        except TimeoutError:
            return Error(
                f"node {node}: eval run {q.run} did not end within its {q.deadline_s:.0f}s (a slow engine, or many "
                "items): run it --via trainer",
                "via",
            )
        except EvalFailed as e:
            log.warning("eval run %s of %s@%d could not be answered here: %s", q.run, q.adapter, q.version, e)
            return Error(f"node {node}: {e}", "via")
        reply = EngineEvalReply(node=node, engine=engine.label, items=results, seconds=time.monotonic() - started)
        size, limit = len(msgspec.json.encode(reply)), self.deployment.nc.max_payload
        if size > limit:
            return Error(
                f"node {node}: the results of eval run {q.run} ({len(results)} items) take {size / 2**20:.1f} MiB, "
                f"more than this NATS server's max_payload ({limit / 2**20:.1f} MiB): run it --via trainer, whose "
                "results travel through the object store",
                "via",
            )
        log.info("eval run %s: %d items through %s in %.1fs", q.run, len(results), engine.label, reply.seconds)
        return reply

    async def _evaluate(self, q: EngineEvalRequest) -> tuple[Engine, list[ItemResult]]:
        r = self.deployment
        engine = self.engine_for(q)
        loaded = r.served.of(engine.label).get(q.adapter)
        await runnable(q.criteria, r.graders)
        items = await read_rows(r.js, q)
        outputs = await answers(engine, q.adapter, items, q.sampling, q.request_timeout_s, r.http)
        if r.served.of(engine.label).get(q.adapter) != loaded:
            raise EvalFailed(
                f"{engine.label} loaded another version of {q.adapter} while it answered the items: run it again"
            )
        return engine, await grade(q.criteria, items, outputs, r.graders)

    def engine_for(self, q: EngineEvalRequest) -> Engine:
        """An engine of this node that serves adapter@version now and answers (the one the registry named first)."""
        r = self.deployment
        serving = [
            e
            for e in r.engines
            if e.url and r.up.get(e.label, True) and (r.served.of(e.label).get(q.adapter) or [None])[0] == q.version
        ]
        if not serving:
            raise EvalFailed(
                f"no engine of this node serves {q.adapter}@{q.version} now (it moved, or its engine does not "
                "answer); `jetlora adapters show` says where it is loaded"
            )
        return next((e for e in serving if e.label == q.engine), serving[0])


async def read_rows(js, q: EngineEvalRequest) -> list[ItemResult]:
    """The run's items: the rft dataset's rows in order (as the trainer numbers them), nothing answered yet."""
    ref = q.dataset
    if ref.sha256 is None:
        raise EvalFailed(f"dataset {ref.name} came without its sha256 pin: an evals service older than this agent?")
    try:
        data = await fetched(js, names.DATASETS_BUCKET, names.dataset_object(ref.name, ref.owner), ref.sha256)
    except (DownloadError, OSError, NotFoundError) as err:
        raise EvalFailed(
            f"dataset {ref.name} ({ref.sha256[:12]}…) could not be read: {err}; was it replaced or deleted?"
        ) from None
    try:
        return await asyncio.to_thread(items_of, data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise EvalFailed(f"dataset {ref.name} holds a row that is not an rft row: {err}") from None


def items_of(data: bytes) -> list[ItemResult]:
    """Each non-blank line: its fields but `messages` (the graders' item) and its conversation (the input)."""
    items: list[ItemResult] = []
    for line in data.removeprefix(UTF8_BOM).splitlines():
        if not line.strip():
            continue
        row, fields = _rows.decode(line), _fields.decode(line)
        fields.pop("messages", None)
        messages = [{"role": m.role, "content": m.content} for m in row.messages]
        items.append(ItemResult(index=len(items), item=fields, input=messages, outputs=[], scores={}))
    return items
