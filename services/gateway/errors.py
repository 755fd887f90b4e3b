"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with `param` naming the field."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from schemas import names
from schemas.gateway import ApiError, ErrorBody
from schemas.validate import field_error
from services.gateway import numbers
from services.gateway.terms import openai_terms

_encode = msgspec.json.Encoder().encode
_any = msgspec.json.Decoder().decode
JSON_MAX = 4 * 2**20  # a JSON request's body (a job's settings): the app's limit; uploads are streamed instead
TENANT = web.RequestKey("tenant", str)  # set from the request's key by the app's middleware, before any handler


class OpenAIError(Exception):
    """Raised by a handler: the status and the error the client gets."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.error = status, ApiError(message=message, type=type, param=param, code=code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def not_found(what: str, ident: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"No {what} found with id '{ident}'.", param, f"{what.replace(' ', '_')}_not_found")


def is_token(value: str) -> bool:
    """Whether an id from a URL can name anything (names.check_token's rule); any other is simply not found."""
    try:
        names.check_token(value, "id")
    except ValueError:
        return False
    return True


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


def error_response(e: OpenAIError) -> web.Response:
    return json_response(ErrorBody(e.error), e.status)


def too_large() -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is over {JSON_MAX // 2**20} MiB, more than any JSON request of this API needs; "
        "training data goes in a file: upload it with POST /v1/files and name it as training_file",
        None,
        "request_too_large",
    )


async def read_json(request: web.Request, cls):
    """The body as cls, read only up to JSON_MAX: a larger one (declared, or found so while reading) is a 413."""
    if request.content_length is not None and request.content_length > JSON_MAX:
        raise too_large()
    try:
        data = await request.read()  # the app's client_max_size is JSON_MAX
    except web.HTTPRequestEntityTooLarge:
        raise too_large() from None
    return decode(data, cls)


def decode(data: bytes, cls):
    """A request body as cls, or a 400 naming the field that is wrong: one msgspec found, or a number out of
    range anywhere in it (numbers.py)."""
    try:
        raw = _any(data)
    except msgspec.DecodeError as e:
        found = numbers.locate(data)
        if found is not None:
            raise number_refused(*found) from None
        raise bad_request(f"the body is not valid JSON ({e}); send a JSON object") from None
    if (found := numbers.unfit(raw)) is not None:
        raise number_refused(*found)
    if cls == dict[str, Any] and not isinstance(raw, dict):
        raise bad_request(f"the body is a JSON {type(raw).__name__}, not an object; send a JSON object")
    try:
        return raw if cls == dict[str, Any] else msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        err = field_error(e)
        reason = openai_terms(err.reason)
        raise bad_request(f"{err.field}: {reason}" if err.field else reason, err.field or None) from None


def number_refused(field: str, why: str) -> OpenAIError:
    return bad_request(f"{field}: {why}" if field else why, field or None, "invalid_number")
