"""check(): everything wrong with a grader at once, each error naming its field and the fix. Without a context
only the grader itself is checked (formulas, templates, metrics, ranges, labels, a multi grader's size); with one,
also whether it can run here (a judge engine for model graders and the image hosts it may fetch, the sandbox for
python graders, whose source is loaded there). check_async is the same for async callers: cancelling it kills the
sandboxes it started, and `deadline` bounds their time together."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from schemas.graders import (
    Content,
    Grader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from schemas.validate import FieldError
from services.graders import blocking, formula, judge, sandbox, templates
from services.graders.context import GraderContext
from services.graders.deadline import Deadline
from services.graders.similarity import EMBEDDING_METRICS

MAX_SOURCE = 256 * 1024
MAX_GRADERS = 16  # graders one multi grader holds in all, nested multi graders and their graders counted


@dataclass(frozen=True)
class _Load:
    """A python grader's source, to be loaded in the sandbox where its error would stand."""

    field: str
    source: str


def check(grader: Grader, field: str = "grader", context: GraderContext | None = None) -> list[FieldError]:
    """Every error, [] for a grader that can run (here, given a context). Synchronous: loads python graders'
    sources in sandboxes on a loop of its own; async callers use check_async."""
    found = _static(grader, field, context)
    if not any(isinstance(e, _Load) for e in found):
        return [e for e in found if isinstance(e, FieldError)]
    return blocking.run(_loaded(found, context, None))


async def check_async(
    grader: Grader, field: str = "grader", context: GraderContext | None = None, deadline: Deadline | None = None
) -> list[FieldError]:
    """check() for async callers; `deadline` bounds the sandbox time of every source it loads together."""
    if context is not None and context.python_graders != "off":
        await asyncio.to_thread(sandbox.status)  # probed once, off the loop
    return await _loaded(_static(grader, field, context), context, deadline)


async def _loaded(found: list[FieldError | _Load], context: GraderContext | None, deadline: Deadline | None):
    errors: list[FieldError] = []
    for e in found:
        if isinstance(e, FieldError):
            errors.append(e)
            continue
        assert context is not None
        why = await sandbox.check_source_async(e.source, context, deadline)
        if why:
            errors.append(FieldError(e.field, f"{why}; define grade(sample, item) returning a number"))
    return errors


def count(grader: Grader) -> int:
    """Graders in this one, itself included."""
    return 1 + sum(count(g) for g in grader.graders.values()) if isinstance(grader, MultiGrader) else 1


def too_many(held: int, field: str) -> FieldError | None:
    """The error for a multi grader that holds `held` graders (nested ones and theirs counted), if it is too many."""
    if held <= MAX_GRADERS:
        return None
    return FieldError(
        f"{field}.graders",
        f"this multi grader holds {held} graders (nested ones counted); at most {MAX_GRADERS} are taken: split the "
        "grading, or compute more in one python grader",
    )


def _static(grader: Grader, field: str, context: GraderContext | None) -> list[FieldError | _Load]:
    if isinstance(grader, MultiGrader) and (error := too_many(count(grader) - 1, field)) is not None:
        return [error]
    return _each(grader, field, context)


def _each(grader: Grader, field: str, context: GraderContext | None) -> list[FieldError | _Load]:
    if isinstance(grader, (StringCheckGrader, TextSimilarityGrader)):
        return list(_text(grader, field))
    if isinstance(grader, PythonGrader):
        return _python(grader, field, context)
    if isinstance(grader, (ScoreModelGrader, LabelModelGrader)):
        return list(_model(grader, field, context))
    return _multi(grader, field, context)


def _template(text: str, field: str) -> list[FieldError]:
    why = templates.check(text)
    return [FieldError(field, why)] if why else []


def _text(grader: StringCheckGrader | TextSimilarityGrader, field: str) -> list[FieldError]:
    errors = _template(grader.input, f"{field}.input") + _template(grader.reference, f"{field}.reference")
    if isinstance(grader, TextSimilarityGrader) and grader.evaluation_metric in EMBEDDING_METRICS:
        errors.append(
            FieldError(
                f"{field}.evaluation_metric",
                "cosine needs an embedding model, which this fleet does not serve; use fuzzy_match, bleu, gleu, "
                "meteor or rouge_1..rouge_5, rouge_l",
            )
        )
    return errors


def _python(grader: PythonGrader, field: str, context: GraderContext | None) -> list[FieldError | _Load]:
    if not grader.source.strip():
        return [FieldError(f"{field}.source", "give the source of a function grade(sample, item) -> float")]
    if len(grader.source.encode()) > MAX_SOURCE:
        return [FieldError(f"{field}.source", f"the source is over {MAX_SOURCE // 1024} KiB; make it smaller")]
    if context is None:
        return []
    why = sandbox.refusal(context)
    if why:
        return [FieldError(f"{field}.type", why)]
    return [_Load(f"{field}.source", grader.source)]


def _content(content: Content, field: str, context: GraderContext | None) -> list[FieldError]:
    if isinstance(content, str):
        return _template(content, field)
    parts = content if isinstance(content, list) else [content]
    errors: list[FieldError] = []
    for k, part in enumerate(parts):
        where = f"{field}[{k}]" if isinstance(content, list) else field
        if isinstance(part, str):
            errors += _template(part, where)
        elif hasattr(part, "text"):
            errors += _template(part.text, f"{where}.text")
        elif hasattr(part, "image_url"):
            errors += _template(part.image_url, f"{where}.image_url")
            literal = "{{" not in part.image_url  # a template's URL is checked as rendered, sample by sample
            if context is not None and literal and (why := judge.image_refusal(part.image_url, context)):
                errors.append(FieldError(f"{where}.image_url", why))
    return errors


def _model(grader: ScoreModelGrader | LabelModelGrader, field: str, context: GraderContext | None) -> list[FieldError]:
    errors: list[FieldError] = []
    if not grader.input:
        errors.append(FieldError(f"{field}.input", "give the messages the judge model reads (with templates)"))
    for k, message in enumerate(grader.input):
        errors += _content(message.content, f"{field}.input[{k}].content", context)
    if not grader.model.strip():
        errors.append(FieldError(f"{field}.model", "name the judge model (one the judge engine serves)"))
    if isinstance(grader, ScoreModelGrader):
        errors += _score_settings(grader, field)
    else:
        errors += _labels(grader, field)
    if context is not None and not context.judge_url:
        errors.append(
            FieldError(
                f"{field}.model",
                "no judge engine is configured here for model graders; the operator names an OpenAI-compatible "
                f"engine that serves the judge model ({context.command} --judge-url URL)",
            )
        )
    return errors


def _score_settings(grader: ScoreModelGrader, field: str) -> list[FieldError]:
    errors = []
    if grader.range is not None:
        r = grader.range
        if len(r) != 2 or not all(math.isfinite(x) for x in r) or r[0] >= r[1]:
            errors.append(FieldError(f"{field}.range", f"got {r}; give two finite numbers [low, high], low < high"))
    p = grader.sampling_params
    if p is not None:
        if p.temperature is not None and not 0 <= p.temperature <= 2:
            errors.append(FieldError(f"{field}.sampling_params.temperature", "give a temperature in [0, 2]"))
        if p.top_p is not None and not 0 < p.top_p <= 1:
            errors.append(FieldError(f"{field}.sampling_params.top_p", "give a top_p in (0, 1]"))
        if p.max_completions_tokens is not None and p.max_completions_tokens < 1:
            errors.append(FieldError(f"{field}.sampling_params.max_completions_tokens", "give at least 1"))
    return errors


def _labels(grader: LabelModelGrader, field: str) -> list[FieldError]:
    errors = []
    if not grader.labels or len(set(grader.labels)) != len(grader.labels):
        errors.append(FieldError(f"{field}.labels", "give the labels the judge picks from, each once"))
    if not grader.passing_labels:
        errors.append(FieldError(f"{field}.passing_labels", "give the labels that pass (a subset of labels)"))
    unknown = [label for label in grader.passing_labels if label not in grader.labels]
    if unknown:
        errors.append(FieldError(f"{field}.passing_labels", f"{unknown} are not among labels {grader.labels}"))
    return errors


def _multi(grader: MultiGrader, field: str, context: GraderContext | None) -> list[FieldError | _Load]:
    errors: list[FieldError | _Load] = []
    if not grader.graders:
        errors.append(FieldError(f"{field}.graders", "name at least one grader"))
    try:
        formula.parse(grader.calculate_output, set(grader.graders))
    except formula.FormulaError as e:
        errors.append(FieldError(f"{field}.calculate_output", str(e)))
    for name, sub in grader.graders.items():
        errors += _each(sub, f"{field}.graders.{name}", context)
    return errors
