"""tinker:// paths (a model's saves, as the client names them), and a session's reply read as the answer expected
or the call's failure."""

from __future__ import annotations

from typing import Any

from schemas.sessions import CallError
from services.gateway.tinker.futures import CallFailed
from services.gateway.tinker.http import TinkerRefusal

SCHEME = "tinker://"
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}  # and checkpoint_type


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{model_id}/{kind}/{name}"


def parse_path(path: object, where: str = "path") -> tuple[str, str, str]:
    """(model id, kind, name) of tinker://<model>/<weights|sampler_weights>/<name>."""
    parts = path.removeprefix(SCHEME).split("/") if isinstance(path, str) and path.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in KINDS or not parts[2]:
        raise TinkerRefusal(400, f"{where} {str(path)[:200]!r} is not tinker://<model>/weights|sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


def answered(reply: Any, expected: type) -> Any:
    """The session's answer, or the call's failure as the client shows it."""
    if isinstance(reply, CallError):
        raise CallFailed(reply.message + (f" (field {reply.field})" if reply.field else ""))
    if not isinstance(reply, expected):
        raise CallFailed(f"the session answered {type(reply).__name__}, not {expected.__name__}", "server")
    return reply
