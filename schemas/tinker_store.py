"""The Tinker API's state as the gateways keep it in JetStream, so that any gateway serves any client and a gateway
that restarts loses nothing a client was told: sessions, training models, sampling sessions, every call (a future)
and the order a model's calls run in.

    names.TINKER_KV (no age limit: a finished session's records are deleted after the operator's retention)
        gateway.<gateway>                   GatewayRecord: a gateway that is up (written every LIVE_S / 3)
        session.<tenant>.<session>          SessionRecord
        model.<tenant>.<model>              ModelRecord (a model id "<session>:train:<n>" or "<session>:base:<n>")
        sampler.<tenant>.<sampler>          SamplerRecord ("<model>:sample:<name>", or "<model>:sample")
        save.<tenant>.<model>.<name>        SamplerSave: a named sampler save, its adapter in names.ARTIFACTS_BUCKET;
                                            kept until deleted or its TTL passes, whether or not its session lives
        holds.<tenant>.<kind>               Holds: what the tenant holds of one bound (sessions, models, samplers),
                                            each taken by a revision-checked write, so a bound holds across requests
                                            and gateways
    names.TINKER_FUTURES_KV (max age FUTURE_TTL_S: a future nobody fetched goes)
        call.<tenant>.<request>             FutureRecord ("<model>:<seq_id>" in the model's order, "<model>:s:<hex>"
                                            run at once: samples)
    names.TINKER_RESULTS_BUCKET (object store, max age FUTURE_TTL_S)
        <tenant>/<request>[.call]           a result (or a call) too large for a KV value

Ids travel in keys escaped by `token` ('.' becomes '=', ':' becomes '.'), so every record of a session lies under
`<kind>.<tenant>.<session>.>` and goes with one purge."""

from __future__ import annotations

import re
from typing import Any, Literal

from msgspec import Struct, field

from schemas.jobs import JobRequest
from schemas.sessions import PingResult, SessionCall, SessionSpec

FUTURE_TTL_S = 24 * 3600  # names.TINKER_FUTURES_KV's and the results bucket's max age
LIVE_S = 15.0  # a gateway not heard of this long is gone: the models whose calls it ran are taken over
ID = re.compile(r"^[A-Za-z0-9_-]+(:[A-Za-z0-9._-]+)*$")  # what the ids above look like (a name may hold '.')


def token(ident: str) -> str:
    """An id as KV key tokens: 'sess-1:train:0' -> 'sess-1.train.0' ('.' inside a name becomes '=')."""
    return ident.replace(".", "=").replace(":", ".")


def ident(tokens: str) -> str:
    """The id `token` escaped."""
    return tokens.replace(".", ":").replace("=", ".")


def gateway_key(gateway: str = "*") -> str:
    return f"gateway.{gateway}"


def session_key(tenant: str, session: str) -> str:
    return f"session.{tenant}.{token(session)}"


def model_key(tenant: str, model: str) -> str:
    return f"model.{tenant}.{token(model)}"


def sampler_key(tenant: str, sampler: str) -> str:
    return f"sampler.{tenant}.{token(sampler)}"


def save_key(tenant: str, model: str, name: str) -> str:
    return f"save.{tenant}.{token(model)}.{token(name)}"


EXPORTED = "_export-"  # a save_weights_external export's name on the node and in save_key: no client's save name
# starts with '_' (schemas.sessions.SAVED_NAME), so an export never meets a sampler save of the same name


def stored_name(kind: str, name: str) -> str:
    """The name a stored save of a tinker:// path's kind (sampler_weights, external_weights) goes by."""
    return EXPORTED + name if kind == "external_weights" else name


def saves_of(tenant: str, model: str | None = None) -> str:
    """The key filter of a tenant's sampler saves, or of one model's."""
    return f"save.{tenant}.>" if model is None else f"save.{tenant}.{token(model)}.>"


def holds_key(tenant: str, kind: str) -> str:
    return f"holds.{tenant}.{kind}"


def call_key(tenant: str, request: str) -> str:
    return f"call.{tenant}.{token(request)}"


def session_records(tenant: str, session: str) -> list[str]:
    """Key filters that hold every record of one session in names.TINKER_KV, then in names.TINKER_FUTURES_KV."""
    s = token(session)
    return [f"session.{tenant}.{s}", f"model.{tenant}.{s}.>", f"sampler.{tenant}.{s}.>", f"call.{tenant}.{s}.>"]


def ordered_request(model: str, seq: int) -> str:
    return f"{model}:{seq}"


def valid_id(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 400 and bool(ID.match(value))


class GatewayRecord(Struct, kw_only=True):
    id: str
    started: float


class SessionRecord(Struct, kw_only=True):
    """A client session (Tinker's create_session): its models (each a training session, schemas/sessions.py) in the
    order they were made, and when it was last heard."""

    id: str
    tenant: str
    created: float  # wall clock, as every time here
    heard: float  # its last heartbeat
    models: list[str] = field(default_factory=list)  # training models and base samplers, by id
    model_seq: int = 0  # the next model_seq_id it has not used
    sampler_seq: int = 0
    paused: bool = False  # silent for the silence window: its jobs were paused (a heartbeat clears it)
    finished: float | None = None  # when it finished (its client's end, or silence): deleted `retention` after
    user_metadata: dict[str, str] | None = None


class SaveRecord(Struct, kw_only=True):
    """A save_state (weights) or a sampler save: the step it was taken at, and when it goes (a TTL the client set)."""

    step: int
    time: float
    expires: float | None = None


class ModelRecord(Struct, kw_only=True):
    """A training model (its session job) or a base model's sampler, and where its ordered calls are."""

    id: str
    tenant: str
    session: str
    base_model: str
    kind: Literal["train", "base"] = "train"
    job: str = ""  # its session job, once submitted
    spec: SessionSpec | None = None
    info: PingResult | None = None  # what its trainer said when it started
    next_seq: int = 0  # the seq_id whose turn it is (0: its create); at most a burst behind while a pump runs
    pump: str = ""  # the gateway that runs its calls in order, while one does
    attempt: int = 0  # the job's attempt that answered its last call changing the session (0: none at risk)
    lost: str = ""  # it moved after its node went away: what its next training call is told
    lost_at: int | None = None  # the seq_id `lost` was told to (its answer may not be stored): told again to that
    # call alone, the calls after it not (the client heard it); None: not told yet, the next ordered call is
    saves: dict[str, SaveRecord] = field(default_factory=dict)  # save_state names
    samplers: dict[str, SaveRecord] = field(default_factory=dict)  # unnamed sampler saves (named: SamplerSave)
    created: float = 0.0
    last_request: float = 0.0
    user_metadata: dict[str, str] | None = None


class SamplerSave(Struct, kw_only=True):
    """A named save_weights_for_sampler: the adapter (PEFT's adapter_config.json and adapter_model.safetensors, as
    tar.gz) in names.ARTIFACTS_BUCKET under `object` (names.sampler_save_object(job, name)), uploaded by the node
    that ran the session through the artifact service. Sampling it loads it on demand (an agent fetches the object
    with services.transfer.download.download_named and unpacks it); it is counted in the tenant's `samplers` hold
    until it is deleted or `expires` passes."""

    path: str  # tinker://<model>/sampler_weights/<name>: its id, and the hold's
    tenant: str
    model: str
    session: str
    name: str
    job: str  # the session job that saved it
    base_model: str
    rank: int
    object: str
    sha256: str
    size: int
    step: int
    time: float
    expires: float | None = None
    train_attn: bool = True  # its LoRA layout (with rank): a sampler that loads it has the same
    train_mlp: bool = True
    train_unembed: bool = False
    age_recipients: list[str] = field(default_factory=list)  # an export's files are served age-encrypted to these


class Held(Struct, kw_only=True):
    """One place of a tenant's bound, taken by `id` (a session, a model, a sampler save's path)."""

    id: str
    session: str  # whose end gives it back (sessions and models)
    since: float
    request: str = ""  # a sampler save: the call that makes it (a hold whose call failed is given back)
    expires: float | None = None  # a sampler save's TTL


class Holds(Struct, kw_only=True):
    """Every place a tenant holds of one bound, written only with the revision it was read at."""

    held: list[Held] = field(default_factory=list)


class SamplerRecord(Struct, kw_only=True):
    """A sampling session: a model's adapter as a sampler save left it (weights), as it is (None), or the base."""

    id: str
    tenant: str
    model: str
    weights: str | None
    base_model: str
    model_path: str | None
    created: float = 0.0
    stored: bool = False  # weights names a SamplerSave (in the object store), not one the session holds


class Outcome(Struct, kw_only=True):
    """What retrieve_future answers: a JSON value, a protobuf body, or (too large for a KV value) an object's name
    in names.TINKER_RESULTS_BUCKET holding the body (protobuf when `protobuf`, else JSON)."""

    json: Any = None
    body: bytes | None = None
    object: str = ""
    protobuf: bool = False


class FutureRecord(Struct, kw_only=True):
    """One call a client was given a request id for, until its outcome is stored (and FUTURE_TTL_S after)."""

    id: str  # the request id
    tenant: str
    model: str
    seq: int | None  # its turn in the model's order; None: run at once (a sample)
    kind: str  # how the session's reply becomes the client's answer (services/gateway/tinker/outcomes.py)
    call: SessionCall | None = None
    call_object: str = ""  # the call, in names.TINKER_RESULTS_BUCKET, when too large for a KV value
    job: JobRequest | None = None  # create: the session job to submit
    args: dict[str, Any] = field(default_factory=dict)  # what the answer needs besides the reply (a path, a name)
    call_id: str = ""  # the same for every try of the call: a node answers a repeat, never runs it twice
    created: float = 0.0
    worker: str = ""  # the gateway running it, for calls run at once
    outcome: Outcome | None = None  # set when it is done
