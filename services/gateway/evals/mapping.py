"""OpenAI's Evals objects and jetlora's: testing_criteria as graders (OpenAI's grader JSON, with pass_threshold
beside it), an eval as OpenAI shows it, a run, and a run's output item. Every refusal is a 400 in OpenAI's shape
with `param` naming the field (`testing_criteria[1].source`)."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from schemas.evals import SAMPLES, Criterion, EvalDef, EvalRun, ItemResult, Sampling
from services.gateway.errors import OpenAIError, bad_request
from services.graders import check
from services.graders.decode import decode_grader

SAMPLE_SCHEMA = {  # what OpenAI's custom data source shows for the `sample` namespace
    "type": "object",
    "properties": {"model": {"type": "string"}, "choices": {"type": "array"}, "output_text": {"type": "string"}},
    "required": ["model", "choices", "output_text"],
}
METADATA_KEYS, METADATA_KEY_MAX, METADATA_VALUE_MAX = 16, 64, 512
NO_LOGS = (
    "jetlora keeps no logs of your completions to draw items from; give type 'custom' with an item_schema, and send "
    "the items with each run (data_source.source)"
)


def check_metadata(metadata: Any, field: str = "metadata") -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_KEYS:
        raise bad_request(f"{field}: give at most {METADATA_KEYS} string keys and string values", field)
    for k, v in metadata.items():
        if not isinstance(v, str) or len(k) > METADATA_KEY_MAX or len(v) > METADATA_VALUE_MAX:
            raise bad_request(
                f"{field}.{k}: keys are up to {METADATA_KEY_MAX} characters, values strings of up to "
                f"{METADATA_VALUE_MAX}",
                f"{field}.{k}",
            )
    return metadata


def data_source_config(raw: Any) -> tuple[dict[str, Any], bool]:
    """(item_schema, include_sample_schema) of a `custom` data_source_config."""
    if not isinstance(raw, dict):
        raise bad_request(
            "data_source_config: give an object with type 'custom' and an item_schema", "data_source_config"
        )
    kind = raw.get("type")
    if kind in ("logs", "stored_completions"):
        raise bad_request(f"data_source_config.type {kind!r} is not served: {NO_LOGS}", "data_source_config.type")
    if kind != "custom":
        raise bad_request(f"data_source_config.type: got {kind!r}; give 'custom'", "data_source_config.type")
    extra = set(raw) - {"type", "item_schema", "include_sample_schema"}
    if extra:
        field = f"data_source_config.{sorted(extra)[0]}"
        raise bad_request(f"{field}: unknown field; a custom config has item_schema and include_sample_schema", field)
    schema, sample = raw.get("item_schema"), raw.get("include_sample_schema", False)
    if not isinstance(schema, dict):
        raise bad_request(
            "data_source_config.item_schema: give the JSON schema of an item (an object)",
            "data_source_config.item_schema",
        )
    if not isinstance(sample, bool):
        raise bad_request(
            "data_source_config.include_sample_schema: true or false", "data_source_config.include_sample_schema"
        )
    return schema, sample


def criteria(raw: Any) -> list[Criterion]:
    """testing_criteria as jetlora's criteria: each grader checked where it is; names distinct (results are keyed
    by them)."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= 16:
        raise bad_request("testing_criteria: give 1 to 16 graders", "testing_criteria")
    out: list[Criterion] = []
    for n, one in enumerate(raw):
        field = f"testing_criteria[{n}]"
        if not isinstance(one, dict):
            raise bad_request(f"{field}: a grader is a JSON object with a `type`", field)
        grader_json = {k: v for k, v in one.items() if k != "pass_threshold"}
        threshold = one.get("pass_threshold")
        if one.get("type") == "label_model" and threshold is not None:
            raise bad_request(
                f"{field}.pass_threshold: a label_model passes by its passing_labels; drop pass_threshold",
                f"{field}.pass_threshold",
            )
        if one.get("type") == "text_similarity" and threshold is None:
            raise bad_request(
                f"{field}.pass_threshold: a text_similarity criterion needs one", f"{field}.pass_threshold"
            )
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise bad_request(f"{field}.pass_threshold: give a number", f"{field}.pass_threshold")
        grader, errors = decode_grader(grader_json, field)
        if grader is not None:
            errors = check(grader, field)
        if errors or grader is None:
            raise bad_request("; ".join(f"{e.field}: {e.reason}" for e in errors), errors[0].field, "invalid_grader")
        if any(c.grader.name == grader.name for c in out):
            raise bad_request(f"{field}.name: {grader.name!r} is taken; give each grader its own name", f"{field}.name")
        out.append(Criterion(grader=grader, pass_threshold=None if threshold is None else float(threshold)))
    return out


def native_field(field: str) -> str:
    """The evals service's field (`criteria.1.grader.source`) as the request's (`testing_criteria[1].source`)."""
    return re.sub(r"^criteria\.(\d+)\.grader", r"testing_criteria[\1]", field)


def criterion_object(c: Criterion) -> dict[str, Any]:
    shown = msgspec.to_builtins(c.grader)
    return shown if c.pass_threshold is None else {**shown, "pass_threshold": c.pass_threshold}


def eval_object(e: EvalDef) -> dict[str, Any]:
    properties: dict[str, Any] = {"item": e.item_schema or {"type": "object"}}
    if e.include_sample_schema:
        properties["sample"] = SAMPLE_SCHEMA
    return {
        "object": "eval",
        "id": e.name,
        "name": e.title or e.name,
        "created_at": int(e.created),
        "metadata": e.metadata or {},
        "data_source_config": {
            "type": "custom",
            "schema": {"type": "object", "properties": properties, "required": list(properties)},
        },
        "testing_criteria": [criterion_object(c) for c in e.criteria],
    }


def run_object(r: EvalRun) -> dict[str, Any]:
    source = r.source or {"type": "completions", "model": r.model}
    s = r.summary
    counts = {"total": 0, "passed": 0, "failed": 0, "errored": 0}
    if s is not None:
        failed = max(0, s.items - s.passed - s.errored)
        counts = {"total": s.items, "passed": s.passed, "failed": failed, "errored": s.errored}
    error = None
    if r.state == "failed":
        error = {"code": "run_failed", "message": r.message or "the run's job failed"}
    return {
        "object": "eval.run",
        "id": r.id,
        "eval_id": r.eval,
        "name": r.name,
        "model": source.get("model") or r.model,
        "status": r.state,
        "created_at": int(r.created),
        "data_source": source,
        "metadata": r.metadata or {},
        "error": error,
        "result_counts": counts,
        "per_testing_criteria_results": [
            {"testing_criteria": g.name, "passed": g.passed, "failed": g.failed + g.errored}
            for g in (s.graders if s else [])
        ],
        "per_model_usage": [],
    }


def output_item_id(run: str, index: int) -> str:
    return f"outputitem_{run.removeprefix('evalrun_')}_{index}"


def index_of(run: str, output_item: str) -> int | None:
    prefix = f"outputitem_{run.removeprefix('evalrun_')}_"
    rest = output_item.removeprefix(prefix)
    return int(rest) if output_item.startswith(prefix) and rest.isdigit() else None


def passed(i: ItemResult) -> bool:
    return all(all(flags) for flags in i.passed.values())


def output_item(r: EvalRun, i: ItemResult) -> dict[str, Any]:
    s = r.sampling or Sampling()
    results = [
        {
            "name": name,
            "score": sum(scores) / len(scores) if scores else 0.0,
            "passed": all(i.passed.get(name, [False])),
            "sample": None,
            **({"error": errs[0]} if (errs := [e for e in i.errors.get(name, []) if e]) else {}),
        }
        for name, scores in i.scores.items()
    ]
    errored = any(e for es in i.errors.values() for e in es)
    return {
        "object": "eval.run.output_item",
        "id": output_item_id(r.id, i.index),
        "created_at": int(r.updated),
        "eval_id": r.eval,
        "run_id": r.id,
        "datasource_item": i.item,
        "datasource_item_id": i.index,
        "status": "pass" if passed(i) else "fail",
        "results": results,
        "sample": {
            "input": i.input,
            "output": [{"role": "assistant", "content": o} for o in i.outputs],
            "model": (r.source or {}).get("model") or r.model,
            "temperature": s.temperature,
            "max_completion_tokens": 0 if r.via == SAMPLES else s.max_tokens,  # a jsonl run's: nothing sampled
            "top_p": 1.0,
            "seed": s.seed,
            "finish_reason": "",
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0},
            "error": {"code": "grader_error", "message": "a grader failed on it"} if errored else None,
        },
    }


def unknown_run(run: str) -> OpenAIError:
    return OpenAIError(404, f"No eval run found with id '{run}'.", "run_id", "eval_run_not_found")
