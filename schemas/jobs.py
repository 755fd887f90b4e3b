"""A training job as submitters send it, and the answer to its submission; how the scheduler keeps it, and answers
about it, is schemas/job_status.py."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from schemas.evals import EvalJob
from schemas.gates import GateSpec
from schemas.integrations import Integration
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


class Error(Struct, tag="error", tag_field="type"):
    """A request that could not be served; `field` names the part of the request at fault."""

    error: str
    field: str = ""
