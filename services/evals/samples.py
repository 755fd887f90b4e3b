"""Runs of samples made elsewhere (RunRequest.samples: OpenAI's `jsonl` data source): nothing is sampled; each row's
sample is graded as sent with the eval's graders, here in the evals service, with the grader settings its operator
gave (`jetlora scheduler --python-graders, --judge-url`), a batch at a time, python graders in services/graders'
sandbox, never in this process. The results are stored as a trainer-side
run's `eval` artifact is (one JSON line an item, then the summary: engine_path.complete) and the run finished
with them, its `via` SAMPLES, so output items, result counts and `evals results` read them as any run's. Each run
grades in a task of its own (SampleRuns), so the request that placed it is answered at once; one whose task is gone
(its evals service stopped) is failed by engine_path.expire once its deadline could have passed (tasks.py).

Turns are each tenant's own: AT_ONCE of one tenant's runs grade at a time and WAITING more wait (within their
deadline), so one tenant's slow runs never hold another's; a run past that is refused naming the limit, nothing
stored. Grading is async (services.graders.grade_many_async): a run that reaches its deadline or is cancelled kills
its sandboxes and judge requests, rather than leaving a thread behind."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter

from nats.aio.client import Client

from schemas.engine_evals import DEADLINE_S
from schemas.evals import SAMPLES, Criterion, EvalDef, EvalRun, ItemResult, RunRequest, SampledItem
from services import graders
from services.evals.engine_path import complete, fail
from services.evals.runs import RunError
from services.evals.store import EvalStore
from services.evals.tasks import RunTasks
from services.graders import GraderContext

log = logging.getLogger(__name__)
GRADE_BATCH = 100  # rows graded in one call (one sandbox process for each python grader)
AT_ONCE = 2  # runs of one tenant this service grades at a time; more wait their turn (within their deadline)
WAITING = 8  # runs of one tenant waiting their turn; more are refused


async def runnable(criteria: list[Criterion], context: GraderContext) -> None:
    """A grader this service cannot run (a model grader without --judge-url, python graders not allowed here) is
    refused naming it and the flag, before anything is stored, rather than scoring every sample 0."""
    for n, c in enumerate(criteria):
        errors = await graders.check_async(c.grader, f"criteria.{n}.grader", context)
        if errors:
            raise RunError(f"the evals service cannot run this grader: {errors[0].reason}", errors[0].field)


def draft(e: EvalDef, q: RunRequest, tenant: str | None) -> EvalRun:
    """The run's record as it starts grading: no model, no job, no dataset (its rows came with the request)."""
    if q.adapter is not None or q.base_model is not None:
        raise RunError("a run of samples grades the rows as sent: name no adapter and no base model", "samples")
    now, rows = time.time(), len(q.samples or [])
    return EvalRun(
        id=f"evalrun_{secrets.token_hex(8)}",
        eval=e.name,
        tenant=tenant,
        job="",
        base_model="",
        dataset="",
        state="in_progress",
        created=now,
        updated=now,
        name=q.name or f"{e.name} on {rows} samples",
        metadata=q.metadata,
        source=q.source,
        via=SAMPLES,
        via_note=f"{rows} rows graded as sent: nothing sampled",
    )


async def grade(
    criteria: list[Criterion], rows: list[SampledItem], first: int, context: GraderContext
) -> list[ItemResult]:
    """The rows' samples graded by every criterion, as the trainer grades its own."""
    samples, items = [r.sample for r in rows], [r.item for r in rows]
    results = {c.grader.name: (c, await graders.grade_many_async(c.grader, samples, items, context)) for c in criteria}
    return [
        ItemResult(
            index=first + k,
            item=r.item,
            input=[],
            outputs=[r.sample.output_text],
            scores={name: [rs[k].score] for name, (_, rs) in results.items()},
            errors={name: [rs[k].error] for name, (_, rs) in results.items()},
            passed={name: [rs[k].score >= c.threshold()] for name, (c, rs) in results.items()},
        )
        for k, r in enumerate(rows)
    ]


class SampleRuns(RunTasks):
    """The runs of samples this evals service grades, by run id, each in its own task, on its tenant's turns."""

    def __init__(
        self, nc: Client, store: EvalStore, context: GraderContext, at_once: int = AT_ONCE, waiting: int = WAITING
    ) -> None:
        super().__init__("grading its samples")
        self.js, self.store, self.context = nc.jetstream(), store, context
        self.at_once, self.waiting = at_once, waiting
        self.turns: dict[str | None, asyncio.Semaphore] = {}
        self.held: Counter[str | None] = Counter()  # each tenant's runs grading or waiting

    async def start(self, e: EvalDef, q: RunRequest, tenant: str | None) -> EvalRun:
        """Store the run and start grading it; RunError (nothing stored) where it cannot be graded here."""
        assert q.samples is not None
        run = draft(e, q, tenant)
        if self.held[tenant] >= self.at_once + self.waiting:
            raise RunError(
                f"this tenant already has {self.held[tenant]} runs of samples grading or waiting here ({self.at_once} "
                f"grade at a time, {self.waiting} more may wait): wait for one to end, or send more rows in one run",
                "samples",
            )
        self.held[tenant] += 1  # taken before the awaits below, so that runs started together count each other
        try:
            await runnable(e.criteria, self.context)
            await self.store.put_run(run)
        except BaseException:
            self._release(tenant)
            raise
        self.spawn(run.id, self._run(run, e.criteria, q.samples))
        self.tasks[run.id].add_done_callback(lambda _: self._release(tenant))  # also if cancelled before it starts
        return run

    def _release(self, tenant: str | None) -> None:
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]
            self.turns.pop(tenant, None)

    async def _run(self, run: EvalRun, criteria: list[Criterion], rows: list[SampledItem]) -> None:
        """Grade every row a batch at a time within the deadline (its turn waited for included), then store the
        results and finish the run."""
        started, items = time.monotonic(), []
        turn = self.turns.setdefault(run.tenant, asyncio.Semaphore(self.at_once))
        try:
            async with asyncio.timeout(DEADLINE_S), turn:
                for first in range(0, len(rows), GRADE_BATCH):
                    items += await grade(criteria, rows[first : first + GRADE_BATCH], first, self.context)
        except TimeoutError:
            why = f"grading its {len(rows)} rows did not end within {DEADLINE_S:.0f}s: split them across runs"
            await fail(self.store, run, why)
            return
        try:
            await self._finish(run, items, criteria, time.monotonic() - started)
        except Exception as e:  # the object store away: the run must still end, saying so
            log.exception("eval run %s: its results could not be stored", run.id)
            await fail(self.store, run, f"its results could not be stored ({type(e).__name__}: {e}); run it again")

    async def _finish(self, run: EvalRun, items: list[ItemResult], criteria: list[Criterion], seconds: float) -> None:
        await complete(self.js, self.store, run, items, criteria, f"{len(items)} samples graded in {seconds:.1f}s")
        log.info("eval run %s: %d samples graded", run.id, len(items))
