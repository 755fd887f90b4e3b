"""A run's `jsonl` data source (OpenAI's: samples made elsewhere, graded as they are): its rows, sent in the request
(`file_content`) or in a file of the tenant's (`file_id`), each an `item` and the `sample` the eval's graders grade
(`{"output_text": ...}`), checked against the eval's item_schema and made the RunRequest's `samples`; the evals
service grades them (services/evals/samples.py), sampling nothing. Every refusal names the row's field
(`data_source.source.content[3].sample`), or its line of the file."""

from __future__ import annotations

from typing import Any

from schemas.evals import SAMPLES_MAX, SampledItem
from schemas.graders import Sample
from services.gateway.errors import OpenAIError, bad_request
from services.gateway.evals.items import check_schema, file_rows

DS = "data_source"
SOURCE = f"{DS}.source"


def check(ds: dict[str, Any]) -> dict[str, Any]:
    """The data source's `source`: a jsonl source has nothing else (no model answers it)."""
    extra = set(ds) - {"type", "source"}
    if extra:
        field = f"{DS}.{sorted(extra)[0]}"
        raise bad_request(
            f"{field}: a jsonl data source has type and source only: its rows carry their samples, so no model "
            "answers them (give type 'completions' for that)",
            field,
        )
    source = ds.get("source")
    if not isinstance(source, dict) or source.get("type") not in ("file_content", "file_id"):
        raise bad_request(
            f"{SOURCE}: give type 'file_content' with content [{{'item': {{...}}, 'sample': {{'output_text': "
            "'...'}}}, ...], or 'file_id' with the id of a file of such rows",
            SOURCE,
        )
    return source


async def rows(nc, tenant: str, source: dict[str, Any]) -> list[Any]:
    """The source's rows as sent: each `{"item", "sample"}`; a file's row may also be the item's own fields beside
    its `sample` (an rft row that carries its sample)."""
    found: Any
    if source["type"] == "file_id":
        found = [_unwrapped(r) for r in await file_rows(nc, tenant, source.get("id"), f"{SOURCE}.id", SAMPLES_MAX)]
    else:
        found = source.get("content")
        if not isinstance(found, list) or not found:
            raise bad_request(
                f"{SOURCE}.content: give the rows, [{{'item': {{...}}, 'sample': {{'output_text': '...'}}}}, ...]",
                f"{SOURCE}.content",
            )
    if len(found) > SAMPLES_MAX:
        raise bad_request(f"{SOURCE}: {len(found)} rows; a run takes up to {SAMPLES_MAX}", SOURCE)
    return found


def _unwrapped(row: Any) -> Any:
    if not isinstance(row, dict) or isinstance(row.get("item"), dict):
        return row
    return {"item": {k: v for k, v in row.items() if k != "sample"}, "sample": row.get("sample")}


def sampled(found: list[Any], schema: dict[str, Any] | None, source: dict[str, Any]) -> list[SampledItem]:
    """Each row as the evals service takes it: its item holds what the item_schema requires, its sample a text."""
    out = []
    for n, row in enumerate(found):
        item = row.get("item") if isinstance(row, dict) else None
        if not isinstance(item, dict):
            raise _refused(source, n, "item", "give the item as an object")
        out.append(SampledItem(item=item, sample=sample_of(row.get("sample"), source, n)))
    check_schema([r.item for r in out], schema, source)
    return out


def sample_of(raw: Any, source: dict[str, Any], n: int) -> Sample:
    """A row's sample as graders see it: its output_text, and output_json (sent, or the text where it is a JSON
    object) and output_tools where given."""
    if not isinstance(raw, dict):
        why = "give the sample its graders grade, {'output_text': '...'}: a jsonl row is an item and its sample"
        raise _refused(source, n, "sample", why)
    text = raw.get("output_text")
    if not isinstance(text, str):
        raise _refused(source, n, "sample.output_text", "give the sample's text as a string")
    tools = raw.get("output_tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _refused(source, n, "sample.output_tools", "give a list of tool calls (objects)")
    given = raw.get("output_json")
    if given is not None and not isinstance(given, dict):
        raise _refused(source, n, "sample.output_json", "give an object, or leave it out")
    parsed = Sample.from_model_sample(text).output_json
    return Sample(output_text=text, output_json=given if given is not None else parsed, output_tools=tools)


def _refused(source: dict[str, Any], n: int, path: str, why: str) -> OpenAIError:
    """A refusal of row n's `path`: named as its field where the rows were sent, as its line where in a file."""
    if source.get("type") == "file_id":
        return bad_request(f"{SOURCE}.id: line {n + 1} of {source.get('id')}: {path}: {why}", f"{SOURCE}.id")
    field = f"{SOURCE}.content[{n}].{path}"
    return bad_request(f"{field}: {why}", field)
