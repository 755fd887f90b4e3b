"""/v1/fine_tuning/alpha/graders/validate and /run, as OpenAI's client calls them: a grader checked (every error,
`param` naming the first one's field) and run on one model sample and its item; python graders in the sandbox,
never in the gateway's process. Each call takes one of its tenant's own turns (GraderContext.tenant_calls at a
time, tenant_waiting more waiting, then 429), and its python graders, loads and runs together, have at most
request_sandbox_s of sandbox time."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from schemas.gateway import GraderRunErrors, GraderRunMetadata, GraderRunResponse
from schemas.graders import Grader, GradeResult, LabelModelGrader, MultiGrader, Sample, ScoreModelGrader
from schemas.validate import FieldError
from services.gateway.errors import TENANT, OpenAIError, bad_request, json_response, read_json
from services.gateway.tenant_turns import TenantTurns
from services.graders import Deadline, GraderContext, check_async, grade_many_async
from services.graders.decode import decode_grader


class Graders:
    def __init__(self, context: GraderContext) -> None:
        self.context = context
        self.turns = TenantTurns("grader calls", context.tenant_calls, context.tenant_waiting)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/fine_tuning/alpha/graders/validate", self.validate),
            web.post("/v1/fine_tuning/alpha/graders/run", self.run),
        ]

    def _deadline(self) -> Deadline:
        s = self.context.request_sandbox_s
        return Deadline.after(
            s,
            f"this request's {s:g} s of sandbox time (its python graders' loads and runs together): use fewer or "
            "faster python graders",
        )

    async def _grader(self, body: dict[str, Any], deadline: Deadline) -> Grader:
        """The body's grader, checked against what this gateway can run; a 400 naming every field that is wrong."""
        if "grader" not in body:
            raise bad_request("grader: missing required field; give the grader to check", "grader")
        grader, errors = decode_grader(body["grader"], "grader")
        if grader is not None:
            errors = await check_async(grader, "grader", self.context, deadline)
        if errors or grader is None:
            raise _invalid(errors)
        return grader

    async def validate(self, request: web.Request) -> web.Response:
        body = await read_json(request, dict[str, Any])
        async with self.turns.turn(request[TENANT]):
            grader = await self._grader(body, self._deadline())
        return json_response({"grader": msgspec.to_builtins(grader)})

    async def run(self, request: web.Request) -> web.Response:
        body = await read_json(request, dict[str, Any])
        sample = body.get("model_sample")
        if not isinstance(sample, str):
            raise bad_request("model_sample: give the model's output as a string", "model_sample")
        item = body.get("item", {})
        if item is not None and not isinstance(item, dict):
            raise bad_request("item: give the dataset item as a JSON object (the templates' `item`)", "item")
        async with self.turns.turn(request[TENANT]):
            deadline = self._deadline()
            grader = await self._grader(body, deadline)
            started = time.monotonic()
            [result] = await grade_many_async(
                grader, [Sample.from_model_sample(sample)], [item or {}], self.context, deadline
            )
        return json_response(_response(grader, result, time.monotonic() - started))


def _invalid(errors: list[FieldError]) -> OpenAIError:
    message = "; ".join(f"{e.field}: {e.reason}" for e in errors)
    return bad_request(message, errors[0].field if errors else "grader", "invalid_grader")


def _models(grader: Grader) -> list[str]:
    if isinstance(grader, (ScoreModelGrader, LabelModelGrader)):
        return [grader.model]
    if isinstance(grader, MultiGrader):
        return sorted({m for sub in grader.graders.values() for m in _models(sub)})
    return []


def _errors(result: GradeResult) -> GraderRunErrors:
    errors = GraderRunErrors(message=result.error or None)
    kind = result.error_kind or ("other_error" if result.error else "")
    if hasattr(errors, kind) and isinstance(getattr(errors, kind), bool):
        setattr(errors, kind, True)
    if kind == "python_grader_runtime_error":
        errors.python_grader_runtime_error_details = result.error
    elif kind == "python_grader_server_error":
        errors.python_grader_server_error_type = "sandbox"
    elif kind == "model_grader_server_error":
        errors.model_grader_server_error_details = result.error
    return errors


def _response(grader: Grader, result: GradeResult, seconds: float) -> GraderRunResponse:
    usage = {", ".join(_models(grader)): {"total_tokens": result.token_usage}} if result.token_usage else {}
    scores: dict[str, Any] = dict(result.sub_scores) if isinstance(grader, MultiGrader) else {grader.name: result.score}
    metadata = GraderRunMetadata(
        errors=_errors(result),
        execution_time=seconds,
        name=grader.name,
        type=grader.__struct_config__.tag,  # type: ignore[arg-type]
        scores=scores,
        token_usage=result.token_usage or None,
    )
    return GraderRunResponse(
        reward=result.score,
        metadata=metadata,
        sub_rewards=dict(result.sub_scores),
        model_grader_token_usage_per_model=usage,
    )
