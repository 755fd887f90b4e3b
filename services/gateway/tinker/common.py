"""What the Tinker routes share: tinker:// paths, a session's answer or its failure, the session job of a training
model, the caller's session and base model, and a body's values checked as a schema's Struct."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from schemas.jobs import JobRequest
from schemas.sessions import CallError, SessionSpec
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.futures import CallFailed
from services.gateway.tinker.http import TinkerRefusal, field
from services.gateway.tinker.sessions import Session, Sessions

T = TypeVar("T")
SCHEME = "tinker://"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{model_id}/{kind}/{name}"


def parse_path(path: str, where: str = "path") -> tuple[str, str, str]:
    """(model id, kind, name) of tinker://<model>/<weights|sampler_weights>/<name>."""
    parts = path.removeprefix(SCHEME).split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not parts[2]:
        raise TinkerRefusal(400, f"{where} {path!r} is not tinker://<model>/weights|sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


def answered(reply_: Any, expected: type) -> Any:
    """The session's answer, or the call's failure as the client shows it."""
    if isinstance(reply_, CallError):
        raise CallFailed(reply_.message + (f" (field {reply_.field})" if reply_.field else ""))
    if not isinstance(reply_, expected):
        raise CallFailed(f"the session answered {type(reply_).__name__}, not {expected.__name__}", "server")
    return reply_


def session_job(base: BaseModel, spec: SessionSpec, model_id: str) -> JobRequest:
    """The session job of a training model: the tenant's, on the base model's nodes, moved (not lost) if its node
    dies."""
    job = JobRequest(
        model=base.name,
        base_dir=base.base_dir,
        accelerator=base.accelerator,  # type: ignore[arg-type]
        session=spec,
        retries=3,  # a node that dies moves the session to another, from its last saved state
        label=f"tinker {model_id}",
        idempotency_key=f"tinker {model_id}",  # a create_model sent again is the same job, not a second one
    )
    job.train.method = "session"
    return job


def session_and_base(
    sessions: Sessions, models: dict[str, BaseModel], tenant: str, data: dict
) -> tuple[Session, BaseModel]:
    """The caller's session (404 if not its own) and the base model it names (400 if not served here)."""
    session = session_of(sessions, tenant, data)
    name = field(data, "base_model")
    base = models.get(name)
    if base is None:
        raise TinkerRefusal(
            400, f"base_model {name!r} is not served here; get_server_capabilities lists {sorted(models)}"
        )
    return session, base


def session_of(sessions: Sessions, tenant: str, data: dict) -> Session:
    session = sessions.session(tenant, field(data, "session_id"))
    if session is None:
        raise TinkerRefusal(404, f"no session {data['session_id']!r} of yours: create_session first")
    return session


def checked(values: dict, kind: type[T], where: str) -> T:
    """values as `kind`, its constraints checked, or a 400 naming the field."""
    try:
        return msgspec.convert(values, kind)
    except msgspec.ValidationError as e:
        raise TinkerRefusal(400, f"{where}: {e}") from None
