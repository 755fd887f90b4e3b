"""What the Tinker client expects of every answer: its key in X-API-Key (a jetlora key behind Tinker's `tml-`
prefix, which the client insists on), JSON bodies, and refusals as 4xx with a `detail` it shows (a 4xx without a
body, or a 5xx, it retries for minutes)."""

from __future__ import annotations

import logging
import secrets
import time
import weakref

import msgspec
from aiohttp import web

from services.gateway.answers import REQUEST_ID
from services.gateway.faults import FAULTS
from services.gateway.keys import KeyStore

log = logging.getLogger(__name__)
TINKER_PREFIX = "tml-"  # TINKER_API_KEY=tml-<a jetlora key>
KEY_BELIEVED_S = 1.0  # a key the store confirmed is taken for its tenant this long: a deleted key stops within it
KEYS_KEPT = 4096
_encode = msgspec.json.Encoder().encode


class TinkerRefusal(Exception):
    """A request refused as sent: the client raises it at once (400, 401, 403, 404 or 422), naming the field."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class Fault(Exception):
    """A request the gateway failed on in a way nobody foresaw, already logged with its traceback under `ident`."""

    def __init__(self, ident: str) -> None:
        super().__init__(ident)
        self.ident = ident


def fault_id() -> str:
    return "err-" + secrets.token_hex(8)


def logged_fault(request: web.Request) -> Fault:
    """The fault being handled (call it from an `except`), logged with its traceback under the request's own id
    (the one its x-request-id header carries), and counted with the gateway's other faults (GET /healthz)."""
    ident = request.get(REQUEST_ID) or fault_id()
    faults = request.app.get(FAULTS)
    if faults is not None:
        faults.count += 1
    log.exception("Tinker API %s %s failed (request %s)", request.method, request.path, ident)
    return Fault(ident)


def fault_reply(fault: Fault) -> web.Response:
    """A 500 in the shape the client shows, naming the request id the gateway's log has the traceback under."""
    detail = (
        f"the gateway failed on this request in a way it did not foresee; give the operator its request id "
        f"{fault.ident} (the gateway's log has what went wrong under it)"
    )
    return reply({"detail": detail, "request_id": fault.ident, "category": "server"}, 500)


def reply(obj, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


def refused(e: TinkerRefusal) -> web.Response:
    return reply({"detail": e.detail}, e.status)


_confirmed: weakref.WeakKeyDictionary[KeyStore, dict[str, tuple[str, float]]] = weakref.WeakKeyDictionary()


async def tenant_of(request: web.Request, keys: KeyStore) -> str:
    """The tenant of the request's key. A client sends four requests a training step (two calls, two fetches): the
    key's record is read from the store once per KEY_BELIEVED_S, not once per request (a NATS round trip each)."""
    key = request.headers.get("X-API-Key", "").strip()
    known = _confirmed.setdefault(keys, {})
    held = known.pop(key, None)
    if held is not None and time.monotonic() - held[1] < KEY_BELIEVED_S:
        known[key] = held
        return held[0]
    tenant = await keys.tenant_of(key.removeprefix(TINKER_PREFIX)) if key.startswith(TINKER_PREFIX) else None
    if tenant is not None:
        known[key] = (tenant, time.monotonic())
        while len(known) > KEYS_KEPT:
            del known[next(iter(known))]
    if tenant is None:
        raise TinkerRefusal(
            401, "unknown API key: give TINKER_API_KEY=tml-<a jetlora key> (`jetlora keys create --tenant T` makes one)"
        )
    return tenant


async def body(request: web.Request) -> dict:
    try:
        value = await request.json()
    except ValueError:
        raise TinkerRefusal(400, "the body is not JSON") from None
    if not isinstance(value, dict):
        raise TinkerRefusal(400, "the body is not a JSON object")
    return value


def field(data: dict, name: str, kind: type | tuple = str, default=...):
    """data[name] of the kind asked, or a 400 naming it."""
    if name not in data or data[name] is None:
        if default is not ...:
            return default
        raise TinkerRefusal(400, f"{name} is missing")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TinkerRefusal(400, f"{name} has the wrong type ({type(value).__name__})")
    return value


METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 32, 100, 1000


def user_metadata(data: dict) -> dict[str, str] | None:
    """A body's user_metadata (strings, a few), kept as given, or a 400 naming what to change."""
    metadata = data.get("user_metadata")
    if metadata is None or metadata == {}:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_KEYS:
        raise TinkerRefusal(400, f"user_metadata: give an object of up to {METADATA_KEYS} string values")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise TinkerRefusal(400, f"user_metadata[{str(key)[:40]!r}]: a string of up to {METADATA_VALUE_CHARS} "
                                     f"characters, under a key of up to {METADATA_KEY_CHARS}")  # fmt: skip
    return dict(metadata)
