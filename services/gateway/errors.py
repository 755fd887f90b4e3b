"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with `param` naming the field."""

from __future__ import annotations

import msgspec
from aiohttp import web

from schemas import names
from schemas.gateway import ApiError, ErrorBody
from schemas.validate import field_error

_encode = msgspec.json.Encoder().encode
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


def decode(data: bytes, cls):
    """A request body as cls, or a 400 naming the field msgspec found wrong."""
    try:
        return msgspec.json.decode(data, type=cls)
    except msgspec.ValidationError as e:
        err = field_error(e)
        raise bad_request(f"{err.field}: {err.reason}" if err.field else err.reason, err.field or None) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the body is not valid JSON ({e}); send a JSON object") from None
