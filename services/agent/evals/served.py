"""A gated canary's eval through one of this node's engines (schemas/served.py): the items the candidate's trainer-side
run answered (its `eval` artifact in the object store, sha256 checked) are answered again by the engine under the
served name, through its chat completions API as users reach it (the engine renders the messages with the model's
chat template, as the trainer did), sampled as that run sampled them (greedy at temperature 0, no penalties), and
graded by the eval's graders through services/graders (python graders in its sandbox process, never in the agent's;
grading runs in a thread, off the event loop). The score is the gate's: the mean over items of the eval's item score.

Bounded: every completion has its time-out and the whole eval its deadline (ServedEval.deadline_s, on this node's own
clock); what cannot be evaluated raises EvalFailed saying why, never hangs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import msgspec
from nats.js.errors import NotFoundError

from schemas import names
from schemas.evals import RESULT_LINE, Criterion, ItemResult, Sampling
from schemas.gates import item_score
from schemas.graders import Sample
from schemas.served import CONCURRENCY, ServedEval, ServedScore
from services import graders
from services.agent.engine_http import EngineHttp
from services.agent.engines import Engine, post_json
from services.aio import cancel_and_wait
from services.graders import GraderContext
from services.graders.context import PythonGraders
from services.transfer.download import DownloadError, fetch_object, fetch_small


class EvalFailed(Exception):
    """The served eval could not be run: why, and what to do."""


def grader_context(env: dict[str, str], work_dir: Path) -> GraderContext:
    """Where this node grades: the settings its trainers grade with (`jetlora agent --judge-url,
    --judge-api-key-file, --python-graders`, as the agent hands them to its trainers; an operator's
    JETLORA_JUDGE_API_KEY in the agent's own environment too), its sandboxes under the work directory."""
    said = env.get("JETLORA_PYTHON_GRADERS", "auto")
    python: PythonGraders = "on" if said == "on" else "off" if said == "off" else "auto"
    return GraderContext(
        judge_url=env.get("JETLORA_JUDGE_URL") or None,
        judge_api_key=env.get("JETLORA_JUDGE_API_KEY") or os.environ.get("JETLORA_JUDGE_API_KEY") or None,
        judge_image_hosts=tuple(h for h in env.get("JETLORA_JUDGE_IMAGE_HOSTS", "").split(",") if h),
        python_graders=python,
        single_tenant=env.get("JETLORA_SINGLE_TENANT") == "1",
        scratch_dir=str(work_dir / "graders"),
        command="jetlora agent",
    )


async def evaluate(js, engine: Engine, name: str, e: ServedEval, context: GraderContext, http: EngineHttp):
    """The engine's served score on the eval, under `name`; EvalFailed where it cannot be had by its deadline."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(e.deadline_s):
            await runnable(e.criteria, context)
            items = await read_items(js, e)
            outputs = await answers(engine, name, items, e.sampling, e.request_timeout_s, http)
            served = await grade(e.criteria, items, outputs, context)  # cancelled at the deadline: sandboxes killed
    except TimeoutError:
        raise EvalFailed(
            f"it did not end within its {e.deadline_s:.0f}s ({len(e.criteria)} graders, {e.items} items): a slow "
            "engine, or a deadline too short for the eval (promote with a longer --canary-deadline)"
        ) from None
    return score(e, items, served, time.monotonic() - started)


async def runnable(criteria: list[Criterion], context: GraderContext) -> None:
    """A grader this node cannot run (a model grader without --judge-url, python graders not allowed here) fails the
    eval naming the flag, rather than scoring every answer 0. The sandboxes' scratch directory is made here."""
    await asyncio.to_thread(Path(context.scratch()).mkdir, parents=True, exist_ok=True)
    for n, c in enumerate(criteria):
        errors = await graders.check_async(c.grader, f"criteria.{n}.grader", context)
        if errors:
            raise EvalFailed(f"this node cannot run the eval's graders: {errors[0].field}: {errors[0].reason}")


async def read_items(js, e: ServedEval) -> list[ItemResult]:
    """The trainer-side run's item results (its `eval` artifact)."""
    try:
        data = await fetched(js, names.ARTIFACTS_BUCKET, e.results, e.sha256)
    except (DownloadError, OSError, NotFoundError) as err:
        raise EvalFailed(f"the trainer-side run {e.run}'s results ({e.results}) could not be read: {err}") from None
    try:
        items = await asyncio.to_thread(_decoded, data)
    except msgspec.DecodeError as err:
        raise EvalFailed(f"the trainer-side run {e.run}'s results ({e.results}) do not decode: {err}") from None
    if len(items) != e.items:
        raise EvalFailed(f"the trainer-side run {e.run} holds {len(items)} items, the canary says {e.items}")
    return items


async def fetched(js, bucket: str, name: str, sha256: str) -> bytes:
    """An object's bytes, its sha256 checked: in memory where small, else through a file (removed after)."""
    data = await fetch_small(js, bucket, name, sha256)
    if data is not None:
        return data
    tmp = await asyncio.to_thread(tempfile.mkdtemp, prefix="jetlora-served-eval-")
    try:
        await fetch_object(js, bucket, name, Path(tmp) / "object", sha256)
        return await asyncio.to_thread((Path(tmp) / "object").read_bytes)
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)


def _decoded(data: bytes) -> list[ItemResult]:
    lines = [RESULT_LINE.decode(line) for line in data.splitlines() if line.strip()]
    return sorted((x for x in lines if isinstance(x, ItemResult)), key=lambda r: r.index)


def _body(engine: Engine, name: str, messages: list[dict[str, str]], s: Sampling, k: int) -> dict:
    """A chat completion as the trainer samples: no top-k, top-p, min-p or penalties (each engine's words)."""
    body: dict = {
        "model": name,
        "messages": messages,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": 1.0,
        "seed": s.seed + k,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    if engine.kind == "llamacpp":
        return body | {"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0}
    return body | {"repetition_penalty": 1.0, "top_k": -1, "min_p": 0.0}


async def answers(
    engine: Engine, name: str, items: list[ItemResult], s: Sampling, timeout_s: float, http: EngineHttp
) -> list[list[str]]:
    """Each item's `n` completions through the engine under `name` (one where greedy: the same n times),
    CONCURRENCY at once, each within `timeout_s`."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(r: ItemResult, k: int) -> str:
        async with gate:
            body = _body(engine, name, r.input, s, k)
            try:
                code, text = await post_json(f"{engine.url}/v1/chat/completions", body, timeout_s, http=http)
            except OSError as err:
                raise EvalFailed(f"item {r.index}: the engine did not answer: {err}") from None
            if code != 200:
                raise EvalFailed(f"item {r.index}: a chat completion under {name} failed ({code}): {text[:300]}")
            try:
                return json.loads(text)["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError):
                raise EvalFailed(
                    f"item {r.index}: the engine's answer is not a chat completion: {text[:200]}"
                ) from None

    async def item(r: ItemResult) -> list[str]:
        if s.temperature == 0:
            return [await one(r, 0)] * s.n
        return [await one(r, k) for k in range(s.n)]

    tasks = [asyncio.create_task(item(r)) for r in items]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # the first failure ends the eval: the others are not left asking the engine
        await cancel_and_wait(tasks)


async def grade(
    criteria: list[Criterion], items: list[ItemResult], outputs: list[list[str]], context: GraderContext
) -> list[ItemResult]:
    """The served answers graded by every criterion, as the trainer's were (cancelling it kills its sandboxes)."""
    rows = [{**r.item, "messages": r.input} for r, texts in zip(items, outputs) for _ in texts]
    samples = [Sample.from_model_sample(text) for texts in outputs for text in texts]
    results = {c.grader.name: (c, await graders.grade_many_async(c.grader, samples, rows, context)) for c in criteria}
    served, at = [], 0
    for i, r in enumerate(items):
        span, at = slice(at, at + len(outputs[i])), at + len(outputs[i])
        served.append(
            ItemResult(
                index=r.index,
                item=r.item,
                input=r.input,
                outputs=outputs[i],
                scores={name: [g.score for g in rs[span]] for name, (_, rs) in results.items()},
                errors={name: [g.error for g in rs[span]] for name, (_, rs) in results.items()},
                passed={name: [g.score >= c.threshold() for g in rs[span]] for name, (c, rs) in results.items()},
            )
        )
    return served


def score(e: ServedEval, trainer: list[ItemResult], served: list[ItemResult], seconds: float) -> ServedScore:
    """The served score against the trainer's answers: the mean, each grader's, and the first item scored lower."""
    mine = [item_score(r) for r in served]
    theirs = {r.index: item_score(r) for r in trainer}
    graders_ = {
        c.grader.name: _mean([sum(s) / len(s) for r in served if (s := r.scores.get(c.grader.name))])
        for c in e.criteria
    }
    lower = next((r for r, t in zip(served, trainer) if item_score(r) < theirs[t.index]), None)
    example = ""
    if lower is not None:
        trained = next(t for t in trainer if t.index == lower.index)
        example = (
            f"item {lower.index}: served {lower.outputs[0][:80]!r} (score {item_score(lower):.2f}) where the trainer "
            f"answered {trained.outputs[0][:80] if trained.outputs else ''!r} ({theirs[lower.index]:.2f})"
        )
    return ServedScore(
        eval=e.eval,
        run=e.run,
        items=len(served),
        samples=sum(len(r.outputs) for r in served),
        mean=_mean(mine),
        graders=graders_,
        errored=sum(1 for r in served if any(err for errs in r.errors.values() for err in errs)),
        agree=sum(1 for r, t in zip(served, trainer) if r.outputs == t.outputs),
        seconds=round(seconds, 2),
        example=example,
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
