"""The NATS plumbing every service shares: JetStream resources, durable publishing, typed requests and answers."""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from collections.abc import Awaitable, Callable, Coroutine
from types import UnionType
from typing import Any, TypeVar, overload

import msgspec
import nats
from nats.aio.client import Client
from nats.js.api import KeyValueConfig, ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from nats.micro.service import Group

from schemas import names, subject_parts, trainer_lease
from schemas.jobs import Error, Rejected
from schemas.tinker_store import FUTURE_TTL_S
from schemas.validate import FieldError, InvalidRequest, decoder_for

log = logging.getLogger(__name__)
T = TypeVar("T")
_enc = msgspec.json.Encoder()
DEFAULT_TIMEOUT = 5.0
NO_RESPONDER_RETRIES = (0.05, 0.2, 0.5, None)
LEASE_TTL_S = 3.0  # the lease bucket's max age: a dead leader's lease is gone this long after its last renewal
IDEMPOTENCY_S = 24 * 3600.0  # the idempotency bucket's max age until a scheduler sets its own window


async def ensure_resources(nc: Client, replicas: int = 1) -> None:
    """Create jetlora's stream, KV buckets and object store where they do not exist yet."""
    js = nc.jetstream()
    stream = StreamConfig(
        name=names.JOBS_STREAM,
        subjects=names.JOBS_STREAM_SUBJECTS,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=30 * 24 * 3600,
        max_bytes=4 * 1024**3,
        num_replicas=replicas,
        duplicate_window=120,
    )
    index = StreamConfig(
        name=names.JOB_INDEX_STREAM,
        subjects=names.JOB_INDEX_SUBJECTS,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        allow_direct=True,
        duplicate_window=120,
    )
    for config in (stream, index):  # the index keeps what retention keeps: its entries go with their jobs
        try:
            await js.stream_info(str(config.name))
        except NotFoundError:
            try:
                await js.add_stream(config)
            except BadRequestError:  # created by another service at the same moment
                pass
    for bucket, kw in (
        (names.JOBS_KV, dict(history=1)),
        (names.LEASE_KV, dict(history=1, ttl=LEASE_TTL_S)),
        (names.TRAINER_LEASES_KV, dict(history=1, ttl=trainer_lease.KEPT_S)),  # each job's computing attempt
        (names.ADAPTERS_KV, dict(history=16)),
        (names.IDEMPOTENCY_KV, dict(history=1, ttl=IDEMPOTENCY_S)),
        (names.KEYS_KV, dict(history=1)),
        (names.GATEWAY_JOBS_KV, dict(history=1)),
        (names.EVALS_KV, dict(history=1)),
        (names.TINKER_KV, dict(history=1)),
        (names.TINKER_FUTURES_KV, dict(history=1, ttl=FUTURE_TTL_S)),  # a future nobody fetched goes
        (names.TENANTS_KV, dict(history=8)),  # the tenants' quotas, edited live (`jetlora tenants set`)
    ):
        try:
            await js.key_value(bucket)
        except (NotFoundError, BadRequestError):
            await js.create_key_value(KeyValueConfig(bucket=bucket, replicas=replicas, storage=StorageType.FILE, **kw))
    for bucket, ttl in (
        (names.ARTIFACTS_BUCKET, None),
        (names.DATASETS_BUCKET, None),
        (names.TINKER_RESULTS_BUCKET, FUTURE_TTL_S),
    ):
        try:
            await js.object_store(bucket)
        except (NotFoundError, BadRequestError):
            settings = ObjectStoreConfig(replicas=replicas, storage=StorageType.FILE, ttl=ttl)
            await js.create_object_store(bucket, settings)


async def publish_durably(js, subject: str, payload: bytes, msg_id: str, give_up_after: float = 300.0):
    """Publish into JetStream until it is stored, riding out a server restart; msg_id makes retries count once."""
    deadline = asyncio.get_running_loop().time() + give_up_after
    pause = 0.1
    while True:
        try:
            return await js.publish(subject, payload, timeout=2.0, headers={"Nats-Msg-Id": msg_id})
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("JetStream did not take %s (%s); retrying in %.1fs", subject, type(e).__name__, pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)


@functools.cache
def _decoder(reply_type: Any) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(reply_type)


class RequestError(Exception):
    """A request that got no reply, or a reply that did not decode."""


class PayloadTooLarge(RequestError):
    """A request bigger than the server's max_payload: it was never sent."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__(
            f"the request on {subject} is {size / 2**20:,.1f} MiB; this NATS server takes at most "
            f"{limit / 2**20:,.1f} MiB per message (its max_payload)"
        )
        self.size, self.limit = size, limit


@overload
async def request(nc: Client, subject: str, message: Any, reply_type: type[T], timeout: float = ...) -> T: ...
@overload
async def request(nc: Client, subject: str, message: Any, reply_type: UnionType, timeout: float = ...) -> Any: ...


async def request(nc: Client, subject: str, message: Any, reply_type: Any, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Send a Struct as JSON, decode the reply as reply_type (a type, or a union of tagged Structs); errors say
    which subject failed."""
    payload = bytes(message) if isinstance(message, (bytes, bytearray)) else msgspec.json.encode(message)
    try:
        for pause in NO_RESPONDER_RETRIES:  # a service that just (re)started may not be subscribed yet
            try:
                msg = await nc.request(subject, payload, timeout=timeout)
                break
            except nats.errors.NoRespondersError:
                if pause is None:
                    raise
                await asyncio.sleep(pause)
    except nats.errors.MaxPayloadError:
        raise PayloadTooLarge(subject, len(payload), nc.max_payload) from None
    except nats.errors.NoRespondersError:
        raise RequestError(
            f"nothing serves {subject}: is the service running (jetlora up, or jetlora scheduler/artifacts)?"
        ) from None
    except nats.errors.TimeoutError:
        raise RequestError(f"no reply on {subject} within {timeout}s: the service is busy or down") from None
    try:
        return _decoder(reply_type).decode(msg.data)
    except msgspec.DecodeError as e:
        raise RequestError(f"the reply on {subject} did not decode: {e}") from None


def tenant_of(subject: str) -> str | None:
    """The tenant a request's subject names (subject_parts.tenant_of_subject), checked: a reserved or malformed token is
    the asker's mistake, refused naming `tenant` before anything is done."""
    try:
        return subject_parts.tenant_of_subject(subject)
    except ValueError as e:
        raise InvalidRequest([FieldError("tenant", str(e))]) from None


def as_error(errors: list[FieldError]) -> Error:
    """The reply to a request that did not hold: its first error, its field named."""
    first = errors[0]
    return Error(first.reason, field=first.field)


@dataclass
class Concurrently:
    """Answer an endpoint's requests each in a task of `spawn`'s (which awaits them at shutdown), at most `limit`
    at once: for handlers that wait on a store or another service, so one slow request does not hold up the
    requests behind it. With `key` (the request's subject -> whose it is, e.g. its tenant), each key has at most
    `per_key` answered at once, and waits for its own turns before it takes one of the `limit` slots everyone
    shares: one asker's backlog holds no slot another needs. What waits is bounded per key (`queued_per_key`
    requests, `queued_bytes_per_key` bytes); beyond that a request is refused as busy at once."""

    spawn: Callable[[Coroutine[Any, Any, Any]], None]
    limit: int
    per_key: int | None = None
    queued_per_key: int | None = None
    key: Callable[[str], str] = lambda subject: ""
    queued_bytes_per_key: int | None = None

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.limit)
        self._turns: dict[str, asyncio.Semaphore] = {}
        self._waiting: dict[str, tuple[int, int]] = {}  # key -> requests admitted and not yet answered, their bytes

    def admit(self, key: str, size: int = 0) -> bool:
        """Count a request of `key` (of `size` bytes) in, unless that key already has its fill waiting."""
        waiting, held = self._waiting.get(key, (0, 0))
        if self.per_key is not None and self.queued_per_key is not None:
            if waiting >= self.per_key + self.queued_per_key:
                return False
        if self.queued_bytes_per_key is not None and waiting and held + size > self.queued_bytes_per_key:
            return False
        self._waiting[key] = (waiting + 1, held + size)
        return True

    async def take_slot(self) -> None:
        """Without keys, a request waits for a slot before its task starts (what holds the subscription back)."""
        if self.per_key is None:
            await self.slots.acquire()

    async def released(self, answering: Awaitable[None], key: str = "", size: int = 0) -> None:
        """Answer, then give the slots back. With keys, the key's own turn comes first and only then a slot of
        the service's: a key whose requests wait for their turns holds none of the slots everyone shares."""
        try:
            if self.per_key is None:
                try:
                    await answering
                finally:
                    self.slots.release()
            else:
                async with self._turns.setdefault(key, asyncio.Semaphore(self.per_key)), self.slots:
                    await answering
        finally:
            waiting, held = self._waiting[key]
            if waiting > 1:
                self._waiting[key] = (waiting - 1, held - size)
            else:
                del self._waiting[key]
                self._turns.pop(key, None)


def handler(
    serve: Callable[..., Awaitable[Any]],
    request_type: type[T] | None = None,
    *,
    parse: Callable[[bytes], T] | None = None,
    invalid: Callable[[list[FieldError]], Any] = as_error,
    with_subject: bool = False,
) -> Callable[[Any], Awaitable[Any]]:
    """One way to answer a request: decode it (a cached decoder of request_type, or `parse`), answer
    `invalid(errors)` when it does not hold, else `await serve(request)` (`serve(request, subject)` with
    with_subject, for endpoints whose subject carries a token), and encode the reply.

    An error reply (Error, Rejected) keeps its JSON body and also carries micro's error headers
    (Nats-Service-Error, Nats-Service-Error-Code: 400 for the asker's mistake, 500 for ours), so any micro client
    sees it as an error; the answer returns its description, which add_endpoint counts in $SRV.STATS.
    Works for nats.micro endpoints and for plain subscriptions alike (both give .data and .respond)."""
    decode = parse or decoder_for(request_type)  # type: ignore[arg-type]
    name = getattr(serve, "__qualname__", repr(serve))

    async def answer(msg) -> str | None:
        code = "400"
        try:
            request = decode(msg.data)
            reply = await (serve(request, msg.subject) if with_subject else serve(request))
        except InvalidRequest as e:
            reply = invalid(e.errors)
        except Exception as e:  # a fault of ours: the asker still gets an answer, the log the trace
            log.exception("%s failed on a request", name)
            reply, code = Error(f"the service failed on this request ({type(e).__name__}: {e}); see its log"), "500"
        if not getattr(msg, "reply", True):  # a plain message published without a reply subject gets none
            return None
        error = error_text(reply)
        if error is not None and hasattr(msg, "respond_error"):  # a micro request
            await msg.respond_error(code, error, data=_enc.encode(reply))
        else:
            await msg.respond(_enc.encode(reply))
        return error

    return answer


def error_text(reply: object) -> str | None:
    """The one-line description of an error reply (None: not one), as micro's Nats-Service-Error header holds it."""
    if isinstance(reply, Error):
        text = f"{reply.field}: {reply.error}" if reply.field else reply.error
    elif isinstance(reply, Rejected):
        text = "; ".join(f"{e.field}: {e.reason}" if e.field else e.reason for e in reply.errors)
    else:
        return None
    return " ".join(text.split())[:1024]  # a header value holds no line breaks


async def add_endpoint(
    group: Group,
    name: str,
    answer: Callable[[Any], Awaitable[Any]],
    subject: str | None = None,
    *,
    concurrently: Concurrently | None = None,
) -> None:
    """Serve `answer` (a handler()) as a micro endpoint whose error replies count in $SRV.STATS; with
    `concurrently`, requests are answered at once, each in its own task, up to its limit.

    nats-py's micro counts an error only when a handler raises, and then answers it again with an empty body;
    Go's micro counts every error reply. This counts ours as Go's does, through the endpoint's own counters
    (nats-py 2.x has no public way: tests/test_micro_stats.py notices if that changes)."""
    endpoint = None

    async def counted(request) -> None:
        error = await answer(request)
        if error is not None and endpoint is not None:
            endpoint._num_errors += 1
            endpoint._last_error = error

    async def in_turn(request) -> None:
        assert concurrently is not None
        key, size = concurrently.key(request.subject), len(request.data)
        if not concurrently.admit(key, size):
            busy = Error(f"{key or 'this asker'} has too many requests waiting here; ask again in a moment")
            await request.respond_error("503", error_text(busy) or "busy", data=_enc.encode(busy))
            return
        await concurrently.take_slot()
        concurrently.spawn(concurrently.released(counted(request), key, size))

    await group.add_endpoint(name=name, subject=subject or name, handler=in_turn if concurrently else counted)
    endpoint = next((e for e in reversed(getattr(group._service, "_endpoints", [])) if e._name == name), None)
