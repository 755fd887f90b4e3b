"""score_model and label_model: a judge model this fleet serves, asked through an OpenAI-compatible engine's chat
completions (GraderContext.judge_url, e.g. a vLLM engine's /v1/chat/completions). The grader's `input` messages
are rendered with the templates and sent with a JSON schema for the answer ({"result": number} or
{"result": one of labels}); the answer is read from that JSON, or from a bare number or label."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from schemas.graders import Content, InputMessage, LabelModelGrader, ScoreModelGrader
from schemas.graders import GradeResult
from services.graders import templates
from services.graders.context import GraderContext

PARSE, REFUSAL, SERVER = "model_grader_parse_error", "model_grader_refusal_error", "model_grader_server_error"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the fleet's own engine: no proxy
_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*$")


def chat_url(url: str) -> str:
    """The chat completions URL from what an operator names: the full URL, a base ending /v1, or the server."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return f"{url}/chat/completions" if url.endswith("/v1") else f"{url}/v1/chat/completions"


def grade_model(
    grader: ScoreModelGrader | LabelModelGrader, samples: list[dict[str, Any]], items: list[Any], ctx: GraderContext
) -> list[GradeResult]:
    """Each sample judged by one request to the engine, a few at a time."""
    if not ctx.judge_url:
        why = "no judge engine is configured here for model graders (the operator names one: --judge-url)"
        return [GradeResult(score=0.0, error=why, error_kind=SERVER) for _ in samples]
    with ThreadPoolExecutor(max_workers=max(1, ctx.judge_concurrency)) as pool:
        return list(pool.map(lambda pair: _one(grader, pair[0], pair[1], ctx), zip(samples, items)))


def _one(grader: ScoreModelGrader | LabelModelGrader, sample: dict, item: Any, ctx: GraderContext) -> GradeResult:
    try:
        messages = [_message(m, sample, item) for m in grader.input]
    except templates.TemplateError as e:
        return GradeResult(score=0.0, error=str(e), error_kind="invalid_variable_error")
    try:
        reply = _post(ctx, _body(grader, messages))
    except (OSError, ValueError) as e:  # urllib's errors are OSErrors; a reply that is no JSON, ValueError
        return GradeResult(score=0.0, error=f"the judge engine did not answer ({e})", error_kind=SERVER)
    try:
        message = reply["choices"][0]["message"]
        usage = int((reply.get("usage") or {}).get("total_tokens") or 0)
    except (KeyError, IndexError, TypeError, ValueError):
        return GradeResult(
            score=0.0, error=f"the judge's reply is not a chat completion: {str(reply)[:200]}", error_kind=PARSE
        )
    if message.get("refusal"):
        return GradeResult(
            score=0.0, error=f"the judge refused: {message['refusal']}", error_kind=REFUSAL, token_usage=usage
        )
    result = _answer(grader, str(message.get("content") or ""))
    if isinstance(result, str):
        return GradeResult(score=0.0, error=result, error_kind=PARSE, token_usage=usage)
    return GradeResult(score=result, token_usage=usage)


def _message(m: InputMessage, sample: dict, item: Any) -> dict[str, Any]:
    return {"role": m.role, "content": _content(m.content, sample, item)}


def _content(content: Content, sample: dict, item: Any) -> Any:
    if isinstance(content, str):
        return templates.render(content, sample, item)
    parts = content if isinstance(content, list) else [content]
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, str):
            out.append({"type": "text", "text": templates.render(part, sample, item)})
        elif part.__struct_config__.tag in ("input_text", "output_text"):
            out.append({"type": "text", "text": templates.render(part.text, sample, item)})  # type: ignore[union-attr]
        elif part.__struct_config__.tag == "input_image":
            url = templates.render(part.image_url, sample, item)  # type: ignore[union-attr]
            detail = {"detail": part.detail} if part.detail else {}  # type: ignore[union-attr]
            out.append({"type": "image_url", "image_url": {"url": url, **detail}})
        else:
            audio = part.input_audio  # type: ignore[union-attr]
            out.append({"type": "input_audio", "input_audio": {"data": audio.data, "format": audio.format}})
    return out


def _body(grader: ScoreModelGrader | LabelModelGrader, messages: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = (
        {"type": "number"} if isinstance(grader, ScoreModelGrader) else {"type": "string", "enum": grader.labels}
    )
    schema = {"type": "object", "properties": {"result": result}, "required": ["result"]}
    body: dict[str, Any] = {
        "model": grader.model,
        "messages": messages,
        "response_format": {"type": "json_schema", "json_schema": {"name": "grade", "schema": schema}},
    }
    params = grader.sampling_params if isinstance(grader, ScoreModelGrader) else None
    if params is not None:
        for key in ("temperature", "top_p", "seed", "reasoning_effort"):
            if getattr(params, key) is not None:
                body[key] = getattr(params, key)
        if params.max_completions_tokens is not None:
            body["max_tokens"] = params.max_completions_tokens
    return body


def _post(ctx: GraderContext, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if ctx.judge_api_key:
        headers["Authorization"] = f"Bearer {ctx.judge_api_key}"
    request = urllib.request.Request(
        chat_url(ctx.judge_url or ""), data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with _OPENER.open(request, timeout=ctx.judge_timeout_s) as response:
            reply = json.loads(response.read(8 * 2**20))
    except urllib.error.HTTPError as e:
        detail = e.read(500).decode(errors="replace")
        raise OSError(f"HTTP {e.code}: {detail}") from None
    if not isinstance(reply, dict):
        raise ValueError("the reply is not a JSON object")
    return reply


def _answer(grader: ScoreModelGrader | LabelModelGrader, text: str) -> float | str:
    """The score from the judge's text, or why there is none."""
    try:
        parsed: Any = json.loads(text)
    except ValueError:
        parsed = text.strip()
    value = parsed.get("result") if isinstance(parsed, dict) else parsed
    if isinstance(grader, LabelModelGrader):
        label = str(value).strip() if value is not None else ""
        if label not in grader.labels:
            return f"the judge answered {text[:200]!r}, not one of the labels {grader.labels}"
        return 1.0 if label in grader.passing_labels else 0.0
    if isinstance(value, str) and _NUMBER.match(value):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"the judge answered {text[:200]!r}, not a number"
    low, high = grader.range or [0.0, 1.0]
    if not low <= value <= high:
        return f"the judge's score {value} is outside the grader's range [{low}, {high}]"
    return float(value)
