"""A run's data_source (OpenAI's `completions`) as the run's own items: read from the request (`file_content`) or
from a file of the tenant's (`file_id`), each rendered through `input_messages` (a template over `{{item.x}}`, or an
item_reference), stored as a dataset of rft rows of the tenant's (the item's fields beside the rendered messages)
that the run's job samples and grades. Every refusal names the field it is about."""

from __future__ import annotations

import secrets
import tempfile
from typing import Any

import msgspec

from schemas.datasets import DatasetUpload
from schemas.evals import Sampling
from services.gateway import file_reads
from services.gateway.evals import item_schema
from services.gateway.errors import OpenAIError, bad_request
from services.gateway.lookups import dataset_info
from services.graders.templates import TemplateError, render

ITEMS_PREFIX = "evalitems_"  # the datasets the gateway stores a run's items in (not listed as files)
ITEMS_MAX = 10_000
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SAMPLING_KNOWN = {"temperature", "max_completion_tokens", "top_p", "seed"}
SAMPLING_REFUSED = {"reasoning_effort", "response_format", "tools"}
DS = "data_source"


def check_kind(ds: Any) -> dict[str, Any]:
    """A `completions` data source (a `jsonl` one is evals/samples.py's)."""
    if not isinstance(ds, dict):
        raise bad_request(f"{DS}: give an object with type 'completions' or 'jsonl'", DS)
    kind = ds.get("type")
    if kind != "completions":
        raise bad_request(
            f"{DS}.type: got {kind!r}; give 'completions' (a model of yours answers each item) or 'jsonl' (each "
            "item comes with its sample, made elsewhere)",
            f"{DS}.type",
        )
    extra = set(ds) - {"type", "source", "input_messages", "model", "sampling_params"}
    if extra:
        field = f"{DS}.{sorted(extra)[0]}"
        raise bad_request(f"{field}: unknown field of a completions data source", field)
    if not isinstance(ds.get("model"), str) or not ds["model"]:
        raise bad_request(
            f"{DS}.model: name the model that answers: a base model or a fine-tuned model of yours", f"{DS}.model"
        )
    return ds


def sampling(raw: Any, default: Sampling) -> Sampling | None:
    """sampling_params as jetlora's; None (the eval's) when there are none."""
    field = f"{DS}.sampling_params"
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request(f"{field}: give an object", field)
    for key, value in raw.items():
        if key in SAMPLING_REFUSED and value is not None:
            raise bad_request(f"{field}.{key}: not served (the model samples plain text); drop it", f"{field}.{key}")
        if key not in SAMPLING_KNOWN | SAMPLING_REFUSED:
            raise bad_request(f"{field}.{key}: unknown; give {', '.join(sorted(SAMPLING_KNOWN))}", f"{field}.{key}")
    if raw.get("top_p") not in (None, 1, 1.0):
        raise bad_request(f"{field}.top_p: only 1 is served (temperature alone shapes sampling)", f"{field}.top_p")
    settings = {
        "temperature": raw.get("temperature", default.temperature),
        "max_tokens": raw.get("max_completion_tokens", default.max_tokens),
        "seed": raw.get("seed", default.seed),
    }
    try:
        return msgspec.convert({k: v for k, v in settings.items() if v is not None}, Sampling)
    except msgspec.ValidationError as e:
        wrong = str(e).rpartition("$.")[2].rstrip("`")
        wrong = {"max_tokens": "max_completion_tokens"}.get(wrong, wrong)
        raise bad_request(f"{field}.{wrong}: {e}", f"{field}.{wrong}") from None


async def items(nc, tenant: str, source: Any) -> list[dict[str, Any]]:
    field = f"{DS}.source"
    if not isinstance(source, dict):
        raise bad_request(f"{field}: give type 'file_content' with content, or 'file_id' with id", field)
    if source.get("type") == "file_content":
        content = source.get("content")
        if not isinstance(content, list) or not content:
            raise bad_request(f"{field}.content: give the items, [{{'item': {{...}}}}, ...]", f"{field}.content")
        found = []
        for n, one in enumerate(content):
            if not isinstance(one, dict) or not isinstance(one.get("item"), dict):
                raise bad_request(
                    f"{field}.content[{n}].item: give the item as an object", f"{field}.content[{n}].item"
                )
            found.append(one["item"])
        return _bounded(found, field)
    if source.get("type") == "file_id":
        return _bounded(await _file_items(nc, tenant, source.get("id"), f"{field}.id"), field)
    raise bad_request(
        f"{field}.type: got {source.get('type')!r}; give 'file_content' or 'file_id' (stored completions are not kept)",
        f"{field}.type",
    )


def _bounded(found: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    if len(found) > ITEMS_MAX:
        raise bad_request(f"{field}: {len(found)} items; a run takes up to {ITEMS_MAX}", field)
    return found


async def _file_items(nc, tenant: str, ident: Any, field: str) -> list[dict[str, Any]]:
    """A file of the tenant's, one JSON object a line: `{"item": {...}}` (OpenAI's eval files, purpose "evals",
    whose rows may carry a `sample` too) or the item itself (an rft row: its messages and fields)."""
    rows = await file_rows(nc, tenant, ident, field, ITEMS_MAX)
    return [r["item"] if isinstance(r.get("item"), dict) and "messages" not in r else r for r in rows]


async def file_rows(nc, tenant: str, ident: Any, field: str, most: int) -> list[dict[str, Any]]:
    """The rows of a file of the tenant's (another tenant's is not found), each line's JSON object: refused when
    it holds more than `most` rows before any is read."""
    if not isinstance(ident, str):
        raise bad_request(f"{field}: give the id of a file of yours (POST /v1/files)", field)
    info = await dataset_info(nc, tenant, ident, field)
    rows = await file_reads.all_rows(nc, info, most, field)
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise bad_request(f"{field}: line {n + 1} of {ident} is not a JSON object; each row is one", field)
    return rows


def check_schema(found: list[dict[str, Any]], schema: dict[str, Any] | None, source: dict[str, Any]) -> None:
    """Each item valid under the eval's item_schema (JSON Schema), or a 400 naming the row and the path in it."""

    def refused(n: int, path: str, why: str) -> OpenAIError:
        if source.get("type") == "file_id":
            field = f"{DS}.source.id"
            return bad_request(f"{field}: line {n + 1} of {source.get('id')}: {path}: {why}", field)
        field = f"{DS}.source.content[{n}].{path}"
        return bad_request(f"{field}: {why}", field)

    item_schema.validate_items(found, schema, refused)


def rows(found: list[dict[str, Any]], input_messages: Any) -> list[dict[str, Any]]:
    """Each item as an rft row: its fields, and the messages the model answers rendered from it."""
    field = f"{DS}.input_messages"
    if not isinstance(input_messages, dict) or input_messages.get("type") not in ("template", "item_reference"):
        raise bad_request(f"{field}: give type 'template' with a template, or 'item_reference'", field)
    out = []
    for n, item in enumerate(found):
        if input_messages["type"] == "template":
            messages = _rendered(input_messages.get("template"), item, n)
        else:
            messages = _referenced(input_messages.get("item_reference"), item, n)
        if not messages or messages[-1]["role"] != "user":
            raise bad_request(f"{field}: the messages end with the user turn the model answers", field)
        out.append({**item, "messages": messages})
    return out


def _rendered(template: Any, item: dict[str, Any], n: int) -> list[dict[str, str]]:
    field = f"{DS}.input_messages.template"
    if not isinstance(template, list) or not template:
        raise bad_request(f"{field}: give the messages, [{{'role': 'user', 'content': '{{{{item.x}}}}'}}]", field)
    out = []
    for m, message in enumerate(template):
        at = f"{field}[{m}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"{at}.role: one of {', '.join(ROLES)}", f"{at}.role")
        text = _text(message.get("content"), f"{at}.content")
        try:
            out.append({"role": ROLES[message["role"]], "content": render(text, {}, item)})
        except TemplateError as e:
            raise bad_request(f"{at}.content: item {n}: {e}", f"{at}.content") from None
    return out


def _text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")]
    if len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
        raise bad_request(f"{field}: text only (a string, or input_text parts); images and audio are not served", field)
    return "".join(texts)  # type: ignore[arg-type]


def _referenced(reference: Any, item: dict[str, Any], n: int) -> list[dict[str, str]]:
    field = f"{DS}.input_messages.item_reference"
    path = reference.split(".") if isinstance(reference, str) else []
    found: Any = item
    for key in path[1:] if path[:1] == ["item"] else [None]:
        found = found.get(key) if isinstance(found, dict) and key is not None else None
    ok = isinstance(found, list) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in found
    )
    if not ok:
        raise bad_request(f"{field}: item {n} has no list of {{role, content}} messages at {reference!r}", field)
    return [{"role": ROLES[m["role"]], "content": m["content"]} for m in found]


async def store_rows(nc, tenant: str, found: list[dict[str, Any]], eval_id: str, spool_dir: str | None) -> str:
    """The rows stored as a dataset of the tenant's (checked row by row by the artifact service); its name."""
    from services.transfer.sender import Refusal, upload_dataset

    name = f"{ITEMS_PREFIX}{secrets.token_hex(12)}"
    with tempfile.NamedTemporaryFile(dir=spool_dir, prefix="jetlora-eval-", suffix=".jsonl") as f:
        for row in found:
            f.write(msgspec.json.encode(row) + b"\n")
        f.flush()
        try:
            await upload_dataset(
                nc, name, f.name, DatasetUpload(format="rft", description=f"items of a run of {eval_id}"), tenant=tenant
            )
        except Refusal as e:
            raise OpenAIError(400, f"{DS}.source: the items are refused: {e}", f"{DS}.source") from None
    return name
