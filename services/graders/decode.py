"""A grader from decoded JSON, or every field that is wrong, each named by its path (`grader.graders.answer.operation`,
not msgspec's `graders[...]`). A multi whose `graders` is one grader (openai-python's typed shape) is taken as a
dict holding it under its name."""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.graders import (
    GRADER_TYPES,
    Grader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    normalize_multi,
)
from schemas.validate import FieldError, field_error, struct_errors
from services.graders import formula
from services.graders.check import check, too_many

MAX_NESTING = 4
_CLASSES: dict[str, type[msgspec.Struct]] = {
    "string_check": StringCheckGrader,
    "text_similarity": TextSimilarityGrader,
    "python": PythonGrader,
    "score_model": ScoreModelGrader,
    "label_model": LabelModelGrader,
    "multi": MultiGrader,
}


def decode_grader(raw: Any, field: str = "grader") -> tuple[Grader | None, list[FieldError]]:
    """The grader, or None and every error found (a multi grader holding too many graders: that alone, before any
    of them is looked at)."""
    if (error := too_many(_count(raw, 0) - 1, field)) is not None:
        return None, [error]
    errors = _errors(raw, field, 0)
    if errors:
        return None, errors + [e for e in _semantic(raw, field) if e not in errors]
    try:
        return msgspec.convert(_normalized(raw), Grader), []  # type: ignore[arg-type]
    except msgspec.ValidationError as e:  # what the field-by-field pass missed
        return None, [field_error(e, field)]


def _count(raw: Any, depth: int) -> int:
    """Graders in the raw JSON, itself included (as deep as a multi may nest, and one level more)."""
    raw = normalize_multi(raw)
    if depth > MAX_NESTING or not isinstance(raw, dict) or not isinstance(raw.get("graders"), dict):
        return 1
    return 1 + sum(_count(sub, depth + 1) for sub in raw["graders"].values())


def _normalized(raw: Any) -> Any:
    raw = normalize_multi(raw)
    if isinstance(raw, dict) and raw.get("type") == "multi" and isinstance(raw.get("graders"), dict):
        return {**raw, "graders": {k: _normalized(v) for k, v in raw["graders"].items()}}
    return raw


def _errors(raw: Any, field: str, depth: int) -> list[FieldError]:
    raw = normalize_multi(raw)
    if not isinstance(raw, dict):
        return [FieldError(field, f"a grader is a JSON object with a `type` ({', '.join(GRADER_TYPES)})")]
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in _CLASSES:  # a list or an object is no type (nor hashable)
        return [FieldError(f"{field}.type", f"got {kind!r}; a grader's type is one of {', '.join(GRADER_TYPES)}")]
    fields = {k: v for k, v in raw.items() if k != "type"}
    if kind != "multi" or not isinstance(raw.get("graders"), dict):
        return struct_errors(fields, _CLASSES[kind], field)
    if depth >= MAX_NESTING:
        return [FieldError(f"{field}.graders", f"multi graders nest at most {MAX_NESTING} deep")]
    errors = struct_errors({**fields, "graders": {}}, MultiGrader, field)
    if not raw["graders"]:
        errors.append(FieldError(f"{field}.graders", "name at least one grader"))
    for name, sub in raw["graders"].items():
        errors += _errors(sub, f"{field}.graders.{name}", depth + 1)
    return errors


def _semantic(raw: Any, field: str) -> list[FieldError]:
    """Beside a multi's structural errors, what check() finds in the rest (its formula, the graders that decode),
    so that every error is told at once."""
    raw = normalize_multi(raw)
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str) or raw["type"] not in _CLASSES:
        return []
    if raw["type"] != "multi" or not isinstance(raw.get("graders"), dict):
        if _errors(raw, field, MAX_NESTING):
            return []
        return check(msgspec.convert(_normalized(raw), Grader), field)  # type: ignore[arg-type]
    errors = []
    if isinstance(raw.get("calculate_output"), str):
        try:
            formula.parse(raw["calculate_output"], set(raw["graders"]))
        except formula.FormulaError as e:
            errors.append(FieldError(f"{field}.calculate_output", str(e)))
    for name, sub in raw["graders"].items():
        errors += _semantic(sub, f"{field}.graders.{name}")
    return errors
