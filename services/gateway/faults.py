"""What the gateway answers when a handler fails in a way nobody foresaw: a 500 in OpenAI's error shape (never
aiohttp's bare text) carrying the request's id, which every answer also carries in `x-request-id`; the traceback
goes to the operator's log under that id, and the faults are counted (GET /healthz shows the count), so a client's
report and the log meet."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from aiohttp import web

from services.gateway.errors import OpenAIError

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"  # OpenAI's


@dataclass
class Faults:
    """Unforeseen failures since the gateway started."""

    count: int = 0


FAULTS = web.AppKey("faults", Faults)


def request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


def unforeseen(request: web.Request, ident: str, faults: Faults) -> OpenAIError:
    """The error for a fault being handled (call it from an `except`): logged with its traceback, counted."""
    faults.count += 1
    log.exception("%s %s failed (request %s, fault %d since start)", request.method, request.path, ident, faults.count)
    return OpenAIError(
        500,
        f"The server had an error while processing your request. Retry it; if it fails again, give the operator "
        f"its request id {ident} (the gateway's log has what went wrong under it).",
        None,
        "internal_error",
        "server_error",
    )
