"""grade_many: a grader over a batch of samples, each with its dataset item. Never raises for a bad sample: a
grader that fails, overruns or returns no finite number scores 0 for that sample, its `error` saying why."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgspec

from schemas.graders import (
    Grader,
    GradeResult,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    Sample,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from services.graders import blocking, formula, judge, sandbox, templates
from services.graders.context import GraderContext
from services.graders.deadline import Deadline
from services.graders.similarity import EMBEDDING_METRICS, similarity

OTHER, VARIABLE, FORMULA = "other_error", "invalid_variable_error", "formula_parse_error"


async def grade_many_async(
    grader: Grader, samples: list[Sample], items: list[Any], context: GraderContext, deadline: Deadline | None = None
) -> list[GradeResult]:
    """One result per sample. Cancelling it kills the sandboxes and judge requests it started. `deadline`: when the
    caller's budget of sandbox time ends (python graders past it score 0 naming it)."""
    if len(items) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(items)} items: give one item per sample")
    as_dicts = [msgspec.to_builtins(s) for s in samples]
    return [_finite(r) for r in await _batch(grader, as_dicts, items, context, deadline)]


def grade_many(grader: Grader, samples: list[Sample], items: list[Any], context: GraderContext) -> list[GradeResult]:
    """grade_many_async for synchronous callers (the trainer's rollouts)."""
    return blocking.run(grade_many_async(grader, samples, items, context))


def _failed(error: str, kind: str = OTHER) -> GradeResult:
    return GradeResult(score=0.0, error=error, error_kind=kind)


def _finite(result: GradeResult) -> GradeResult:
    if math.isfinite(result.score):
        return result
    return GradeResult(score=0.0, error=f"the score is {result.score}, not a finite number", error_kind=OTHER)


async def _batch(
    grader: Grader, samples: list[dict], items: list[Any], ctx: GraderContext, deadline: Deadline | None
) -> list[GradeResult]:
    try:
        if isinstance(grader, (StringCheckGrader, TextSimilarityGrader)):  # CPU bound and short: off the loop
            return await asyncio.to_thread(lambda: [_text(grader, s, i) for s, i in zip(samples, items)])
        if isinstance(grader, PythonGrader):
            return await sandbox.run_python_async(grader.source, samples, items, ctx, deadline)
        if isinstance(grader, (ScoreModelGrader, LabelModelGrader)):
            return await judge.grade_model(grader, samples, items, ctx)
        return await _multi(grader, samples, items, ctx, deadline)
    except Exception as e:  # noqa: BLE001 - a grader's own failure is every sample's error, never the caller's
        return [_failed(f"the {type(grader).__name__} failed: {type(e).__name__}: {e}") for _ in samples]


def _text(grader: StringCheckGrader | TextSimilarityGrader, sample: dict, item: Any) -> GradeResult:
    try:
        hyp, ref = templates.render(grader.input, sample, item), templates.render(grader.reference, sample, item)
    except templates.TemplateError as e:
        return _failed(str(e), VARIABLE)
    if isinstance(grader, StringCheckGrader):
        return GradeResult(score=1.0 if string_check(grader.operation, hyp, ref) else 0.0)
    if grader.evaluation_metric in EMBEDDING_METRICS:
        return _failed("evaluation_metric cosine needs an embedding model, which this fleet does not offer")
    return GradeResult(score=similarity(grader.evaluation_metric, hyp, ref))


def string_check(operation: str, text: str, reference: str) -> bool:
    """OpenAI's string_check: eq and ne compare exactly; like is `reference` found in `text`, ilike the same
    ignoring case."""
    if operation == "eq":
        return text == reference
    if operation == "ne":
        return text != reference
    if operation == "like":
        return reference in text
    return reference.casefold() in text.casefold()


async def _multi(
    grader: MultiGrader, samples: list[dict], items: list[Any], ctx: GraderContext, deadline: Deadline | None
) -> list[GradeResult]:
    """Each named grader over the batch, then the formula per sample; a sample any named grader failed on scores 0
    (its error names the grader), so a broken grader never yields a partial reward silently."""
    try:
        tree = formula.parse(grader.calculate_output, set(grader.graders))
    except formula.FormulaError as e:
        return [_failed(f"calculate_output: {e}", FORMULA) for _ in samples]
    named = {
        name: [_finite(r) for r in await _batch(g, samples, items, ctx, deadline)] for name, g in grader.graders.items()
    }
    out = []
    for k in range(len(samples)):
        scores = {name: results[k].score for name, results in named.items()}
        usage = sum(results[k].token_usage for results in named.values())
        failed = [(name, results[k]) for name, results in named.items() if results[k].error]
        if failed:
            error = "; ".join(f"graders.{name}: {r.error}" for name, r in failed)
            out.append(
                GradeResult(
                    score=0.0, error=error, error_kind=failed[0][1].error_kind, sub_scores=scores, token_usage=usage
                )
            )
            continue
        try:
            out.append(GradeResult(score=formula.evaluate(tree, scores), sub_scores=scores, token_usage=usage))
        except formula.FormulaError as e:
            out.append(
                GradeResult(
                    score=0.0, error=f"calculate_output: {e}", error_kind=FORMULA, sub_scores=scores, token_usage=usage
                )
            )
    return out
