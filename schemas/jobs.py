"""A training job as submitters send it, and as the scheduler keeps it."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from msgspec import Meta, Struct, field

from schemas.evals import EvalJob
from schemas.gates import GateSpec
from schemas.integrations import Integration
from schemas.parity import ParityText
from schemas.sessions import SessionSpec
from schemas.text import Name, OneLine, Text
from schemas.training import ATTENTION_AND_MLP, MODULE_NAME, SEED_MAX, STEPS_MAX, LoraConfig, TrainConfig
from schemas.validate import FieldError, pattern

__all__ = [
    "ATTENTION_AND_MLP",
    "MODULE_NAME",
    "SEED_MAX",
    "STEPS_MAX",
    "LoraConfig",
    "Name",
    "OneLine",
    "Text",
    "TrainConfig",
]  # defined beside, used by the job's callers through here

NodeId = Annotated[
    str,
    Meta(
        pattern=pattern(
            r"^[A-Za-z0-9_-]{1,128}$", "must be 1-128 letters, digits, '_' or '-' (it becomes a NATS subject token)"
        ),
        description="one NATS subject token",
    ),
]
JobId = NodeId
TenantId = NodeId
ABSOLUTE_PATH = pattern(
    r"^/[^\x00-\x1f\x7f]*[^/\x00-\x1f\x7f][^\x00-\x1f\x7f]*$",
    "must be an absolute path below / with no control characters (NUL, newline, tab); "
    "give the model directory's full path on the node",
)
PRIORITY_MIN, PRIORITY_MAX = -100, 100  # a job's; a tenant's jobs go up to its ceiling (the scheduler's --quota)
UNEXPORTABLE_TARGETS = {"lm_head", "embed_tokens", "wte", "embed_out"}  # peft saves their tied base weights too


class QA(Struct, forbid_unknown_fields=True):
    """One training example: a question and the answer the adapter should learn."""

    q: Annotated[Text, Meta(description="the question (prompt)")]
    a: Annotated[Text, Meta(description="the answer the model should learn")]


DatasetName = NodeId  # it becomes a subject token of the upload
Sha256 = Annotated[str, Meta(pattern=pattern(r"^[0-9a-f]{64}$", "must be a sha256 in hex: 64 of 0-9a-f"))]


class DatasetRef(Struct, forbid_unknown_fields=True, kw_only=True):
    """A job's data by name: `jetlora datasets ls` lists what there is, `jetlora datasets put` adds one."""

    name: Annotated[DatasetName, Meta(description="the dataset's name, as uploaded with `jetlora datasets put`")]
    sha256: (
        Annotated[
            Sha256,
            Meta(
                description=(
                    "a pin: the job is refused unless the dataset has this content. The scheduler fills it in at submit, so a "
                    "job always trains on what it was submitted with"
                )
            ),
        ]
        | None
    ) = None
    owner: Annotated[
        TenantId | None,
        Meta(
            description=(
                "whose dataset it is: set by the scheduler at submit (a tenant's own, or none for one an admin uploaded); "
                "what a submitter says here is replaced"
            )
        ),
    ] = None


class RegisterSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """Register the job's adapter in the registry when it succeeds (see `jetlora adapters`)."""

    name: Annotated[NodeId, Meta(description="the adapter's name: its versions are NAME@1, NAME@2, ...")]
    promote: Annotated[bool, Meta(description="make it what NAME serves: engines of its base model load it")] = False
    gate: (
        Annotated[GateSpec, Meta(description="promote only if this eval says it beats what NAME serves now")] | None
    ) = None


class InitAdapter(Struct, forbid_unknown_fields=True, kw_only=True):
    """A registered adapter the job starts from (dpo after sft, or more training): its version and stored PEFT
    archive are pinned at submit."""

    name: Annotated[NodeId, Meta(description="a registered adapter of yours, trained on the job's base model")]
    version: Annotated[int, Meta(ge=1, description="which version; none: what the name serves now")] | None = None
    peft: str | None = None  # set by the scheduler: the object-store name of that version's PEFT archive


class JobRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """What a submitter publishes on the submit subject."""

    model: Annotated[Name, Meta(max_length=200, description="catalog name of the served model")]
    base_dir: Annotated[
        str,
        Meta(
            pattern=ABSOLUTE_PATH,
            max_length=4096,
            description="directory of safetensors weights and config.json, on the node",
        ),
    ]
    data: Annotated[list[QA], Meta(description="question/answer pairs sent inline (small jobs); or name a dataset")] = (
        field(default_factory=list)
    )
    dataset: (
        Annotated[DatasetRef, Meta(description="the training data, stored once with `jetlora datasets put`")] | None
    ) = None
    validation_dataset: (
        Annotated[
            DatasetRef,
            Meta(
                description=(
                    "held-out data evaluated at train.eval_steps and at the end (instead of train.eval_fraction)"
                )
            ),
        ]
        | None
    ) = None
    served_by: Literal["vllm", "llamacpp"] = "vllm"
    node: NodeId | None = None
    gpu_mib: Annotated[int, Meta(ge=0, le=16_777_216, description="GPU memory the job needs; 0: any free GPU")] = 0
    accelerator: Literal["gpu", "cpu", "any"] = "gpu"
    devices: Annotated[
        int,
        Meta(
            ge=1,
            le=16,
            description=(
                "GPUs of one node the job trains on at once, one rank each, gpu_mib free on every one; each rank takes "
                "its share of train.batch_size x devices examples a step"
            ),
        ),
    ] = 1
    quantization: Annotated[
        Literal["none", "nf4"],
        Meta(
            description=(
                "nf4: the base model is loaded in 4 bits (bitsandbytes, QLoRA), a quarter of its bf16 memory; GPU only. "
                "The adapter still applies to the full-precision base (its GGUF too)"
            )
        ),
    ] = "none"
    priority: Annotated[int, Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)] = 0
    co_train: Annotated[
        bool,
        Meta(
            description=(
                "false: train alone, never in a co-training group (one trainer process sharing the base model with "
                "other jobs of the same base, as the scheduler's --co-train policy allows)"
            )
        ),
    ] = True
    retries: Annotated[int, Meta(ge=0, le=20, description="times the job is re-queued when its node goes away")] = 0
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    gguf_type: Literal["f16", "f32", "bf16", "q8_0"] = "f16"
    register: RegisterSpec | None = None
    init_adapter: (
        Annotated[
            InitAdapter,
            Meta(
                description=(
                    "start from this registered adapter, its shape replacing lora's; a dpo job's reference is then that "
                    "adapter as it starts"
                )
            ),
        ]
        | None
    ) = None
    session: Annotated[
        SessionSpec | None,
        Meta(description="train.method session's: the adapter a Tinker training client drives (the gateway sets it)"),
    ] = None
    evaluate: Annotated[
        EvalJob | None,
        Meta(description="train.method eval's: the graders and sampling of an eval run (the evals service sets it)"),
    ] = None
    integrations: Annotated[
        list[Integration],
        Meta(
            max_length=8,
            description=("W&B and MLflow runs that receive the job's metrics and samples, besides TensorBoard"),
        ),
    ] = field(default_factory=list)
    label: Annotated[OneLine, Meta(max_length=200)] = ""
    idempotency_key: (
        Annotated[
            OneLine,
            Meta(
                min_length=1,
                max_length=256,
                description=(
                    "a client's own name for this submission: sent again (a retry after a timeout) within the scheduler's "
                    "window, it returns the first job's id and creates nothing"
                ),
            ),
        ]
        | None
    ) = None


class Accepted(Struct, tag="accepted", tag_field="type"):
    job: JobId


class Rejected(Struct, tag="rejected", tag_field="type"):
    errors: list[FieldError]


class Unsure(Struct, tag="unknown", tag_field="type"):
    """The scheduler could not tell whether the job was stored (its write went unanswered, or it stopped leading
    mid-request): `job` is the id it reserved. `job` queries tell once the store answers; a retry with the same
    idempotency_key returns this job, never a second one."""

    job: JobId
    reason: str


SubmitReply = Accepted | Rejected | Unsure

ActiveState = Literal["assigned", "preparing", "running", "uploading"]  # the job holds a device
TerminalState = Literal["succeeded", "failed", "cancelled", "stopped"]  # the job ended; nothing changes it again
JobState = Literal["queued", "paused", ActiveState, TerminalState]  # paused: holds no device, waits for resume
ACTIVE_STATES: frozenset[str] = frozenset(get_args(ActiveState))
TERMINAL_STATES: frozenset[str] = frozenset(get_args(TerminalState))


PROBE_PROMPT = "Hello"  # what a trained adapter is asked, greedily, to fingerprint it (trainer and engines alike)
PROBE_TOKENS = 8  # how many tokens it answers
PROBE_HEAD_TOKENS = 4  # where precisions differ (bf16 engine, fp32 trainer), at least this many must agree


class Probe(Struct, kw_only=True):
    """A trained adapter's greedy answer to PROBE_PROMPT, as its trainer computed it: an engine that serves this
    adapter answers the same (exactly at the same precision; its first PROBE_HEAD_TOKENS tokens where it differs)."""

    prompt: str
    text: str  # the greedy continuation, at most PROBE_TOKENS tokens, decoded without special tokens
    head: str  # its first PROBE_HEAD_TOKENS tokens, decoded
    dtype: str  # the precision the trainer ran in, e.g. "float32", "bfloat16"
    parity: list[ParityText] | None = None  # the probe set's log-probabilities (schemas/parity.py); None: older


class ArtifactRef(Struct):
    """Where one of a job's artifacts lies in the object store."""

    kind: str
    name: str
    size: int
    sha256: str
    probe: Probe | None = None  # the PEFT adapter's fingerprint


class StoredRequest(Struct, kw_only=True):
    """A submitted job as kept in the jobs KV bucket under `request.<id>`: written once, never changed."""

    id: JobId
    request: JobRequest
    created: float
    seq: int = 0  # submission order among equal priorities
    tenant: TenantId | None = None  # from the subject it was submitted on; None: an admin's submission
    index_seq: int = 0  # its entry in the job index (submission order); 0: stored before the index existed


class CheckpointInfo(Struct, kw_only=True):
    """A checkpoint of a job: where it is stored, and how the run stood when it was taken."""

    step: int
    name: str  # object-store name (jetlora artifacts get)
    loss: float | None = None  # train loss of the steps logged last
    eval_loss: float | None = None  # the latest evaluation's
    created: float = 0.0
    eval_reward: float | None = None  # grpo: the latest evaluation's mean reward


class JobStatus(Struct, kw_only=True):
    """Where a job stands, kept under `status.<id>`; no key yet means queued since submission."""

    state: JobState = "queued"
    message: str = ""
    updated: float = 0.0
    node: NodeId | None = None
    device: int | None = None  # the job's first (rank 0's) device
    devices: list[int] = field(default_factory=list)  # all of them, for a job on several; else empty
    group: str | None = None  # the co-training group its attempt trains in (one process on the device); None: alone
    attempt: int = 0  # assignments so far; agents' state events name theirs, so stale ones are ignored
    held_by: list[NodeId] = field(default_factory=list)  # the node of each attempt, oldest first: whose events count
    event_seq: int = 0  # the JOBS stream sequence of the last state event applied: an older one redelivered is stale
    retries_used: int = 0  # times the job was re-queued because its node went away
    train_alone: str = ""  # why it trains alone from now on (split out of a co-training group); "": as it asks
    artifacts: list[ArtifactRef] = field(default_factory=list)
    checkpoint: str | None = None  # object-store name of the latest checkpoint: a re-queued job resumes from it
    checkpoints: list[CheckpointInfo] = field(default_factory=list)  # those stored, oldest first
    paused_by: str | None = None  # "user", or the node and device whose serving engine wanted its memory back
    preempted: str = ""  # who preempted it and why, while it waits to go on from its checkpoint (cleared when placed)
    preempted_at: float = 0.0  # when it was last preempted (wall clock): it is not preempted again within a backoff
    step: int = 0
    steps: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    peak_mib: float | None = None


class JobSummary(Struct, kw_only=True):
    """A job in a listing: its record without the training data."""

    id: JobId
    tenant: TenantId | None
    label: str
    model: str
    state: JobState
    message: str
    node: NodeId | None
    device: int | None
    priority: int
    gpu_mib: int
    created: float
    updated: float
    attempt: int
    step: int
    steps: int
    loss: float | None
    artifacts: list[ArtifactRef]
    paused_by: str | None = None
    devices: list[int] = field(default_factory=list)  # a job on several devices: all of them
    group: str | None = None  # the co-training group it trains (or trained) in
    preempted: str = ""  # queued again after a preemption: who preempted it and why (it goes on from its checkpoint)


def summarize(stored: StoredRequest, status: JobStatus) -> "JobSummary":
    req = stored.request
    return JobSummary(
        id=stored.id,
        tenant=stored.tenant,
        label=req.label,
        model=req.model,
        state=status.state,
        message=status.message,
        node=status.node,
        device=status.device,
        priority=req.priority,
        gpu_mib=req.gpu_mib,
        created=stored.created,
        updated=status.updated or stored.created,
        attempt=status.attempt,
        step=status.step,
        steps=status.steps,
        loss=status.loss,
        artifacts=status.artifacts,
        paused_by=status.paused_by,
        devices=status.devices,
        group=status.group,
        preempted=status.preempted,
    )


class JobQuery(Struct, forbid_unknown_fields=True):
    """Ask for one job (get, cancel, stop)."""

    job: JobId


class JobListQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    """A page of jobs, newest first. `after`: the `next` of the page before (with the same filters): the page then
    holds the jobs older than those, so jobs submitted meanwhile never shift it."""

    state: JobState | None = None
    node: NodeId | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100
    after: Annotated[int, Meta(ge=0)] | None = None


class JobReply(Struct, tag="job", tag_field="type"):
    job: JobSummary


class NodeWhy(Struct, kw_only=True):
    node: NodeId
    reason: str  # "fits", "busy", "no GPU", "insufficient free memory", "draining", ...


class JobWhy(Struct, tag="why", tag_field="type", kw_only=True):
    """Why a job waits (`jetlora why JOB`): the summary its message shows, and each node's reason."""

    job: JobId
    state: JobState
    summary: str
    nodes: list[NodeWhy] = field(default_factory=list)


class JobList(Struct, tag="jobs", tag_field="type"):
    jobs: list[JobSummary]  # newest first
    next: int | None = None  # the `after` of the next page; None: this was the last


class Error(Struct, tag="error", tag_field="type"):
    """A request that could not be served; `field` names the part of the request at fault."""

    error: str
    field: str = ""


class IdempotencyRecord(Struct, kw_only=True):
    """Kept under `idem.<sha256 of the key>` in the jobs bucket: which job a submitter's key made, from what."""

    job: JobId
    request_sha256: str  # of the request as decoded, so the same job sent again matches whatever its formatting
    created: float
    index_seq: int = 0  # the job's "submitted" index entry, once a try wrote it (a retry writes no second one)
