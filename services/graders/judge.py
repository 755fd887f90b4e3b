"""score_model and label_model: a judge model this fleet serves, asked through an OpenAI-compatible engine's chat
completions (GraderContext.judge_url, e.g. a vLLM engine's /v1/chat/completions) with aiohttp on the caller's loop,
so a cancelled grading call cancels its requests. The grader's `input` messages are rendered with the templates and
sent with a JSON schema for the answer ({"result": number} or {"result": one of labels}); the answer is read from
that JSON, or from a bare number or label.

What the judge host does on a tenant's behalf is bounded: an input_image's URL must be a data: URL unless the
operator names the hosts the engine may fetch images from (GraderContext.judge_image_hosts); a redirect is never
followed (it would carry the judge's key to another host); what the engine answers on a failure goes to the
operator's log under a request id, and the tenant sees a fixed message with that id."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import secrets
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from schemas.graders import Content, GradeResult, InputMessage, LabelModelGrader, ScoreModelGrader
from services.graders import templates
from services.graders.context import GraderContext

log = logging.getLogger(__name__)
PARSE, REFUSAL, SERVER = "model_grader_parse_error", "model_grader_refusal_error", "model_grader_server_error"
REPLY_MAX = 8 * 2**20  # the most of a judge's reply that is read
LOGGED_MAX = 2000  # the most of a failed reply's body the operator's log keeps
_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*$")


def chat_url(url: str) -> str:
    """The chat completions URL from what an operator names: the full URL, a base ending /v1, or the server."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return f"{url}/chat/completions" if url.endswith("/v1") else f"{url}/v1/chat/completions"


class ImageRefused(ValueError):
    """An input_image URL the judge engine may not be asked to fetch."""


class JudgeFailed(Exception):
    """The judge engine gave no usable answer; the operator's log has why, under the request id."""


def image_refusal(url: str, ctx: GraderContext) -> str:
    """Why the judge engine may not be sent this image URL, or "" where it may: a data: URL always, an http(s) URL
    only on a host the operator named (no user part, nothing a URL parser could read two ways)."""
    if url[:5].lower() == "data:":
        return ""
    allowed = {h.lower() for h in ctx.judge_image_hosts}
    plain = url.isprintable() and not any(c in url for c in " \\@")
    parts = urlsplit(url) if plain else None
    if parts is not None and parts.scheme in ("http", "https") and (parts.hostname or "") in allowed:
        return ""
    hosts = ", ".join(sorted(allowed)) or "none"
    return (
        "an input_image's image_url must be a data: URL (the image itself, base64) here: the judge engine would "
        f"fetch any other itself; the operator names hosts it may fetch from ({ctx.command} --judge-image-hosts; "
        f"named now: {hosts})"
    )


async def grade_model(
    grader: ScoreModelGrader | LabelModelGrader, samples: list[dict[str, Any]], items: list[Any], ctx: GraderContext
) -> list[GradeResult]:
    """Each sample judged by one request to the engine, `judge_concurrency` at a time."""
    if not ctx.judge_url:
        why = "no judge engine is configured here for model graders (the operator names one: --judge-url)"
        return [GradeResult(score=0.0, error=why, error_kind=SERVER) for _ in samples]
    turns = asyncio.Semaphore(max(1, ctx.judge_concurrency))
    timeout = aiohttp.ClientTimeout(total=ctx.judge_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:  # the fleet's engine: no proxy

        async def judged(sample: dict, item: Any) -> GradeResult:
            async with turns:
                return await _one(session, grader, sample, item, ctx)

        return list(await asyncio.gather(*(judged(s, i) for s, i in zip(samples, items))))


async def _one(
    session: aiohttp.ClientSession,
    grader: ScoreModelGrader | LabelModelGrader,
    sample: dict,
    item: Any,
    ctx: GraderContext,
) -> GradeResult:
    try:
        messages = [_message(m, sample, item, ctx) for m in grader.input]
    except templates.TemplateError as e:
        return GradeResult(score=0.0, error=str(e), error_kind="invalid_variable_error")
    except ImageRefused as e:
        return GradeResult(score=0.0, error=str(e), error_kind="other_error")
    rid = f"judge-{secrets.token_hex(6)}"
    try:
        reply = await _post(session, ctx, _body(grader, messages), rid)
        message = reply["choices"][0]["message"]
        usage = int((reply.get("usage") or {}).get("total_tokens") or 0)
        if not isinstance(message, dict):
            raise TypeError("message is not an object")
    except JudgeFailed:
        return GradeResult(score=0.0, error=_failed(rid), error_kind=SERVER)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        log.warning("judge request %s: the reply is not a chat completion (%s): %s", rid, e, str(reply)[:LOGGED_MAX])
        return GradeResult(
            score=0.0, error=f"the judge's reply is not a chat completion (request id {rid})", error_kind=PARSE
        )
    if message.get("refusal"):
        return GradeResult(
            score=0.0, error=f"the judge refused: {message['refusal']}", error_kind=REFUSAL, token_usage=usage
        )
    result = _answer(grader, str(message.get("content") or ""))
    if isinstance(result, str):
        return GradeResult(score=0.0, error=result, error_kind=PARSE, token_usage=usage)
    return GradeResult(score=result, token_usage=usage)


def _failed(rid: str) -> str:
    return f"the judge engine gave no answer (request id {rid}); the operator's log says why under that id"


def _message(m: InputMessage, sample: dict, item: Any, ctx: GraderContext) -> dict[str, Any]:
    return {"role": m.role, "content": _content(m.content, sample, item, ctx)}


def _content(content: Content, sample: dict, item: Any, ctx: GraderContext) -> Any:
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
            if why := image_refusal(url, ctx):
                raise ImageRefused(why)
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


async def _post(session: aiohttp.ClientSession, ctx: GraderContext, body: dict[str, Any], rid: str) -> dict[str, Any]:
    """The engine's reply as a JSON object; JudgeFailed (logged with the engine's answer) where there is none."""
    url = chat_url(ctx.judge_url or "")
    headers = {"Content-Type": "application/json", "X-Request-Id": rid}
    if ctx.judge_api_key:
        headers["Authorization"] = f"Bearer {ctx.judge_api_key}"
    try:
        async with session.post(url, data=json.dumps(body).encode(), headers=headers, allow_redirects=False) as r:
            data = await _read(r)
            status, where = r.status, r.headers.get("Location", "")
    except TimeoutError:
        log.warning("judge request %s to %s: no answer within %gs", rid, url, ctx.judge_timeout_s)
        raise JudgeFailed from None
    except (aiohttp.ClientError, OSError) as e:
        log.warning("judge request %s to %s: %s: %s", rid, url, type(e).__name__, e)
        raise JudgeFailed from None
    text = data[:LOGGED_MAX].decode(errors="replace")
    if 300 <= status < 400:
        log.warning(
            "judge request %s to %s: HTTP %d to %r, not followed (a redirect would carry the judge's key to another "
            "host); give --judge-url the engine's own address",
            rid,
            url,
            status,
            where,
        )
        raise JudgeFailed
    if status >= 400:
        log.warning("judge request %s to %s: HTTP %d: %s", rid, url, status, text)
        raise JudgeFailed
    try:
        reply = json.loads(data)
    except ValueError:
        log.warning("judge request %s to %s: the reply is not JSON: %s", rid, url, text)
        raise JudgeFailed from None
    if not isinstance(reply, dict):
        log.warning("judge request %s to %s: the reply is not a JSON object: %s", rid, url, text)
        raise JudgeFailed
    return reply


async def _read(r: aiohttp.ClientResponse) -> bytes:
    data = b""
    async for chunk in r.content.iter_chunked(65536):
        data += chunk
        if len(data) > REPLY_MAX:
            raise aiohttp.ClientPayloadError(f"the reply is over {REPLY_MAX} bytes")
    return data


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
