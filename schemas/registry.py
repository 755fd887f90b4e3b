"""The adapter registry: versions of trained adapters, aliases that point at one of them, and what each node's
serving engines have loaded. Kept in a KV bucket (names.ADAPTERS_KV); agents watch it and converge to it. The
bucket's keys and values are a stored format (the end of this module): the registry writes them, agents read
versions and aliases and write their own node statuses through it."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct, field

from schemas import names, nats_subjects
from schemas.jobs import JobId, NodeId, TenantId
from schemas.job_status import Probe
from schemas.gates import Gate, GateSpec
from schemas.parity import ParityFigures
from schemas.served import ServedEval, ServedScore

AdapterName = Annotated[NodeId, Meta(description='what requests to the engine call it (`"model": NAME`)')]
Version = Annotated[int, Meta(ge=1)]


class StoredFile(Struct, kw_only=True):
    """An artifact an adapter version is made of, as the object store holds it."""

    name: str
    sha256: Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]  # it names the node's cache directory
    size: int


class AdapterVersion(Struct, kw_only=True):
    """NAME@N: written once, never overwritten."""

    name: AdapterName
    version: Version
    job: JobId
    base_model: str  # the catalog name of the model it was trained on: the engines serving that model load it
    peft: StoredFile  # tar.gz of the PEFT adapter directory (vLLM)
    gguf: StoredFile | None = None  # the GGUF LoRA (llama.cpp), when the job made one
    r: int
    alpha: float
    target_modules: list[str]
    final_loss: float | None = None
    eval_loss: float | None = None
    created: float = 0.0
    probe: Probe | None = None  # what an engine serving this version answers: `loaded` is checked against it


class Canary(Struct, kw_only=True):
    """A promote under way on a few nodes first: when each of them reports this version `loaded` (verified) by the
    deadline, the alias serves it everywhere; a `failed` or `mismatch` on any, or the deadline, rolls it back. A gated
    canary (`eval`) also needs each node's served score within the trainer-side interval (schemas/served.py)."""

    version: Version
    nodes: list[NodeId]
    deadline: float  # the registry's wall clock, as `started`: never an agent's
    started: float = 0.0
    after: int = 0  # the registry bucket's sequence when the nodes were picked: only reports stored after it count
    eval: ServedEval | None = None  # a gated canary's: the eval its nodes run through their engines


class Alias(Struct, kw_only=True):
    """NAME: the version served now, the versions it pointed at before (newest last), the latest registered."""

    name: AdapterName
    current: int | None = None
    history: list[int] = field(default_factory=list)
    latest: int = 0
    retired: bool = False
    updated: float = 0.0
    tenant: TenantId | None = None  # whose name it is: the first registration claims it (None: an admin's)
    changes: int = 0  # how many times what it serves changed (promote, rollback, retire): a caller's expect_changes
    canary: Canary | None = None  # a promote under way: its nodes serve canary.version, the others `current`
    last_rollout: str = ""  # how the last canary ended, and why
    gate: Gate | None = None  # a gated promote under way (schemas/gates.py): the registry decides it
    last_gate: str = ""  # how the last gate ended, with its figures

    def serving(self, node: str) -> int | None:
        """The version `node` serves: the canary's on a canary node, else the current one (None: retired)."""
        if self.retired:
            return None
        if self.canary is not None and node in self.canary.nodes:
            return self.canary.version
        return self.current


class Smoke(Struct, kw_only=True):
    """A completion through the engine with the adapter's name, right after loading it."""

    latency_ms: float
    text: str


# loaded: the engine answers the version's probe as its trainer did (and its log-probabilities are within parity);
# mismatch: it serves the name, but answers otherwise (another adapter, or none), or its log-probabilities are
# beyond parity's limit (schemas/parity.py); placed: the files are where the engine reads them, but no engine address
# was given to load or check them; needs-restart: placed for an engine that must be restarted to serve it;
# unloaded: retired, or (its message says so) still promoted but unloaded to keep the engine under its
# --engine-max-adapters; on-demand: the same for vLLM's filesystem resolver, whose files stay placed, so vLLM loads it
# again at its next request (unverified until then)
NodeState = Literal["loading", "loaded", "mismatch", "placed", "needs-restart", "failed", "unloaded", "on-demand"]


class NodeAdapterStatus(Struct, kw_only=True):
    """What one engine of one node did with an adapter (published by its agent, kept in the registry)."""

    name: AdapterName
    version: int
    node: NodeId
    engine: str  # e.g. "vllm http://127.0.0.1:8000"
    state: NodeState
    message: str = ""
    smoke: Smoke | None = None
    parity: ParityFigures | None = None  # the engine's log-probabilities against the trainer's (schemas/parity.py)
    served: ServedScore | None = None  # a gated canary's eval through this engine (schemas/served.py)
    updated: float = 0.0  # the agent's clock: for people to read, never for the registry to decide by
    seq: int = 0  # the registry's: the bucket sequence the report was stored at (0 as agents send it)


# --- requests -------------------------------------------------------------------------------------
class RegisterRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Register a succeeded job's artifacts as the next version of NAME (and promote it, if asked)."""

    name: AdapterName
    job: JobId
    promote: bool = False
    gate: GateSpec | None = None  # promote only through this gate (schemas/gates.py)


class PromoteRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    name: AdapterName
    version: Version
    expect: (
        Annotated[
            int,
            Meta(
                ge=0,
                description=(
                    "the version the caller saw as current (0: none); the promote is refused if the alias serves another now"
                ),
            ),
        ]
        | None
    ) = None
    expect_changes: (
        Annotated[
            int,
            Meta(
                ge=0,
                description=(
                    "the alias's `changes` the caller saw; refused if it changed at all since (a 1 -> 2 -> 1 too), so of "
                    "concurrent changes from one state exactly one wins"
                ),
            ),
        ]
        | None
    ) = None
    canary: (
        Annotated[
            str,
            Meta(
                pattern=r"^[1-9][0-9]*%?$",
                description=(
                    "move the name on this many of the nodes serving it first (`2`), or this share of them (`10%`); the rest "
                    "follow once each canary node reports it loaded and verified"
                ),
            ),
        ]
        | None
    ) = None
    canary_deadline_s: Annotated[float, Meta(gt=0)] = 600.0  # the canary nodes' time to verify it
    gate: GateSpec | None = None  # promote only if this eval says it beats what the name serves now


class AliasRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Rollback (to the version before) or retire (serve none, engines unload it) NAME."""

    name: AdapterName
    expect: Annotated[int, Meta(ge=0)] | None = None  # as PromoteRequest's
    expect_changes: Annotated[int, Meta(ge=0)] | None = None  # as PromoteRequest's


class AdapterQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    name: AdapterName


class AdapterListQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    base_model: str | None = None


class AdapterReply(Struct, tag="adapter", tag_field="type", kw_only=True):
    alias: Alias
    versions: list[AdapterVersion]
    nodes: list[NodeAdapterStatus]


class AdapterList(Struct, tag="adapters", tag_field="type", kw_only=True):
    adapters: list[AdapterReply]


class ReferencesQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    """Which of these jobs' artifacts do registered versions reference (what retention must keep)?"""

    jobs: Annotated[list[JobId], Meta(max_length=1000)]


class JobReferences(Struct, kw_only=True):
    job: JobId
    versions: list[str]  # NAME@N of every version made of the job's artifacts
    artifacts: list[str]  # the object-store names those versions reference (`<job>/peft`, `<job>/gguf`)


class References(Struct, tag="references", tag_field="type", kw_only=True):
    """The asked jobs that registered versions reference; a job not listed is referenced by none."""

    jobs: list[JobReferences]


# --- the bucket (names.ADAPTERS_KV) as stored: `alias.<name>` (Alias), `version.<name>.<n>` (AdapterVersion, written
# once), `node.<name>.<node>` (NodeAdapterStatus, written by that node's agent); values are JSON ---------------------
DECODERS: dict[str, msgspec.json.Decoder] = {
    "alias": msgspec.json.Decoder(Alias),
    "version": msgspec.json.Decoder(AdapterVersion),
    "node": msgspec.json.Decoder(NodeAdapterStatus),
}


def adapter_of(key: str) -> str | None:
    """The adapter name a registry key belongs to (`alias.<name>`, `version.<name>.<n>`, `node.<name>.<node>`)."""
    kind, _, rest = key.partition(".")
    if kind not in DECODERS or not rest:
        return None
    return rest.partition(".")[0]


def adapter_subjects(name: str) -> list[str]:
    """The bucket's subjects that hold the keys of an adapter (`adapter_of` is `name`): alias.N, and version.N.x
    and node.N.x."""
    prefix = nats_subjects.kv(names.ADAPTERS_KV).prefix
    return [f"{prefix}*.{name}", f"{prefix}*.{name}.*"]
