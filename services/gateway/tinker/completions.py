"""OpenAI-compatible /v1/completions and /v1/chat/completions of Tinker sampler paths: `model` is a
tinker://<run>/sampler_weights/<name> of the caller's (the key's tenant; a Tinker key, tml-<key>, opens them too),
sampled by a training session as asample samples it (a stored sample, run at once, within max_pending), with its
prompt given as text or as a chat the base model's chat template renders (trainer/session/text.py). So any
OpenAI-speaking tool can try a checkpoint while its training goes on. `stream` answers the whole text as one chunk
(then the finish, then [DONE]); what is not served (logprobs, tools, penalties, echo) is a 400 naming it."""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec
from aiohttp import web

from schemas.sessions import ChatTurn, Sample
from schemas.tinker_store import FutureRecord, Outcome
from services.gateway.errors import TENANT, OpenAIError, bad_request, json_response
from services.gateway.tinker.common import Ctx
from services.gateway.tinker.http import TinkerRefusal
from services.gateway.tinker.paths import SCHEME
from services.gateway.tinker.sampler_paths import resolve_sampler
from services.gateway.tinker.sampling import submit

WAIT_S = 900.0  # a completion waits this long at most for its session (placed, started or resumed)
MAX_N = 16
REFUSED = {  # what is not served, and how to leave it out
    "echo": "echo is not served; leave it out",
    "suffix": "suffix is not served; leave it out",
    "logit_bias": "logit_bias is not served; leave it out",
    "logprobs": "logprobs are not served on this route; sample through Tinker's SamplingClient for log-probabilities",
    "top_logprobs": "top_logprobs are not served; leave it out",
    "tools": "tools are not served; leave them out",
    "functions": "functions are not served; leave them out",
    "tool_choice": "tool_choice is not served; leave it out",
    "presence_penalty": "presence_penalty is not served; leave it out or 0",
    "frequency_penalty": "frequency_penalty is not served; leave it out or 0",
}


class Completions:
    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/completions", self.completion), web.post("/v1/chat/completions", self.chat)]

    async def completion(self, request: web.Request) -> web.StreamResponse:
        data = await _body(request)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            asked: dict[str, Any] = {"text": prompt}
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            asked = {"prompt": prompt}
        else:
            raise bad_request("prompt: give one prompt, as a string or a list of token ids", "prompt")
        result, model = await self._sample(request, data, asked, default_tokens=16)
        choices = [{"index": i, "text": s["text"] or "", "logprobs": None, "finish_reason": _finish(s)}
                   for i, s in enumerate(result["sequences"])]  # fmt: skip
        answer = _answer("cmpl", "text_completion", model, choices, result)
        if data.get("stream") is True:
            chunks = [{**answer, "choices": [{**c, "finish_reason": None}]} for c in choices]
            chunks += [{**answer, "choices": [{**c, "text": ""}]} for c in choices]
            return await _stream(request, chunks, answer, data)
        return json_response(answer)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        data = await _body(request)
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages: give a list of {role, content}", "messages")
        turns = [_turn(m, i) for i, m in enumerate(messages)]
        tokens = data.get("max_completion_tokens", data.get("max_tokens"))
        result, model = await self._sample(request, {**data, "max_tokens": tokens}, {"messages": turns}, 128)
        choices = [{"index": i, "message": {"role": "assistant", "content": s["text"] or ""}, "logprobs": None,
                    "finish_reason": _finish(s)} for i, s in enumerate(result["sequences"])]  # fmt: skip
        answer = _answer("chatcmpl", "chat.completion", model, choices, result)
        if data.get("stream") is True:
            chunk = {**answer, "object": "chat.completion.chunk"}
            chunks = [{**chunk, "choices": [{"index": c["index"], "delta": c["message"], "finish_reason": None}]}
                      for c in choices]  # fmt: skip
            chunks += [{**chunk, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]}
                       for c in choices]  # fmt: skip
            return await _stream(request, chunks, {**answer, "object": "chat.completion.chunk"}, data)
        return json_response(answer)

    async def _sample(self, request: web.Request, data: dict, asked: dict, default_tokens: int) -> tuple[dict, str]:
        """The session's SampleResult (as JSON) for the body's model and settings, and the model's path."""
        ctx, tenant = self.ctx, request[TENANT]
        for name, why in REFUSED.items():
            if data.get(name) not in (None, False, 0, {}, []):
                raise bad_request(why, name)
        options = data.get("stream_options")
        if options is not None and (
            not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)
        ):
            raise bad_request("stream_options: give an object, {\"include_usage\": true or false}, or leave it out",
                              "stream_options")  # fmt: skip
        if data.get("response_format") not in (None, {"type": "text"}):
            raise bad_request("response_format: only text is served", "response_format")
        path = data.get("model")
        if not isinstance(path, str) or not path.startswith(SCHEME):
            raise OpenAIError(404, f"The model {str(path)[:200]!r} is not served on this route: give a Tinker sampler "
                                   "path, tinker://<run>/sampler_weights/<name>", "model", "model_not_found")  # fmt: skip
        call = _call(data, asked, default_tokens)
        try:
            target = await resolve_sampler(ctx, tenant, path, "model")
            call = msgspec.structs.replace(call, weights=target.weights, stored=target.stored, object=target.object)
            future = await submit(ctx, target.model, call, {}, "sample_text")
        except TinkerRefusal as e:
            raise OpenAIError(e.status, e.detail, "model" if e.status == 404 else None) from None
        outcome = await _outcome(ctx, future)
        if outcome.json is None or "error" in outcome.json:
            error = (outcome.json or {}).get("error", "the sample failed")
            server = (outcome.json or {}).get("category") == "server"
            raise OpenAIError(
                500 if server else 400, error, None, None, "server_error" if server else "invalid_request_error"
            )
        return outcome.json, path


def _call(data: dict, asked: dict, default_tokens: int) -> Sample:
    stop = data.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise bad_request("stop: give a string or up to 4 strings", "stop")
    n = data.get("n", 1)
    if data.get("best_of") not in (None, n):
        raise bad_request("best_of is not served (each of the n samples is returned); leave it out", "best_of")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad_request(f"n: give 1 to {MAX_N}", "n")
    values = {"max_tokens": default_tokens if data.get("max_tokens") is None else data["max_tokens"],
              "temperature": 1.0 if data.get("temperature") is None else data["temperature"],
              "top_p": 1.0 if data.get("top_p") is None else data["top_p"], "seed": data.get("seed"),
              "num_samples": n, "stop_strings": stops, "prompt": [], **asked}  # fmt: skip
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        value = values[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad_request(f"{name}: give a number", name)
    if not 0 <= values["temperature"] <= 2:
        raise bad_request("temperature: give 0 to 2", "temperature")
    try:
        return msgspec.convert(values, Sample)
    except msgspec.ValidationError as e:
        where = str(e).rpartition("$.")[2].split("[")[0].rstrip("`")
        raise bad_request(f"{e}", where if where in values else None) from None


def _turn(message: object, i: int) -> ChatTurn:
    if not isinstance(message, dict):
        raise bad_request(f"messages[{i}]: give an object with role and content", f"messages[{i}]")
    role, content = message.get("role"), message.get("content")
    if isinstance(content, list):  # text parts
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad_request(f"messages[{i}].content: text parts only are served", f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if role not in ("system", "user", "assistant", "developer") or not isinstance(content, str):
        raise bad_request(f"messages[{i}]: a role of system, user, assistant or developer, and text content "
                          "(tool messages are not served)", f"messages[{i}]")  # fmt: skip
    return ChatTurn(role=role, content=content)


async def _body(request: web.Request) -> dict:
    try:
        data = await request.json()
    except ValueError:
        raise bad_request("the body is not JSON") from None
    if not isinstance(data, dict):
        raise bad_request("the body is not a JSON object")
    return data


async def _outcome(ctx: Ctx, future: FutureRecord) -> Outcome:
    """The sample's outcome, waited for (the session may be placed, started or resumed first)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        known, outcome = await ctx.book.from_memory(future.tenant, future.id)
        if not known:  # this gateway is closing: the store answers, and a live gateway runs it
            stored = await ctx.book.find(future.tenant, future.id)
            if stored is None:
                break
            outcome = await ctx.book.from_store(stored, ctx.order.revive)
        if outcome is not None:
            return outcome
    raise OpenAIError(
        504, f"the sample did not finish within {WAIT_S:.0f} s; send it again", None, None, "server_error"
    )


def _finish(sequence: dict) -> str:
    return "length" if sequence["stop"] == "length" else "stop"


def _answer(prefix: str, kind: str, model: str, choices: list, result: dict) -> dict:
    completion = sum(len(s["tokens"]) for s in result["sequences"])
    usage = {"prompt_tokens": result["prompt_tokens"], "completion_tokens": completion,
             "total_tokens": result["prompt_tokens"] + completion}  # fmt: skip
    return {"id": f"{prefix}-{secrets.token_hex(12)}", "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}  # fmt: skip


async def _stream(request: web.Request, chunks: list[dict], last: dict, data: dict) -> web.StreamResponse:
    """Server-sent events: each chunk, the usage when asked (stream_options.include_usage), then [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    options = data.get("stream_options") or {}
    usage = [{**last, "choices": [], "usage": last["usage"]}] if options.get("include_usage") else []
    for chunk in chunks + usage:
        if not usage or chunk is not usage[0]:
            chunk = {k: v for k, v in chunk.items() if k != "usage"}
        await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
