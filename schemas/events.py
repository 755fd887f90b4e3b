"""Job events: what the JOBS stream carries, and what the trainer prints on stdout."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct, field

from schemas.jobs import ArtifactRef, JobId, JobRequest, JobState, NodeId


class Progress(Struct, tag="progress", tag_field="type", kw_only=True):
    """One logging step of training (the fields of both seeds' progress)."""

    job: JobId | None = None  # set by the agent when it publishes
    step: int
    steps: int
    epoch: float = 0.0
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens: int = 0  # real (unpadded) tokens seen so far
    tokens_per_s: float | None = None
    elapsed_s: float = 0.0
    eta_s: float | None = None
    peak_mib: float | None = None  # CUDA: max allocated; CPU: peak RSS
    eval_loss: float | None = None
    message: str = ""
    ts: float = 0.0


class StateChange(Struct, tag="state", tag_field="type", kw_only=True):
    """A job moved to a new state (agents report these; the scheduler applies them)."""

    job: JobId
    state: JobState
    node: NodeId
    attempt: int = 0
    message: str = ""
    artifacts: list[ArtifactRef] = field(default_factory=list)
    ts: float = 0.0




class DataFile(Struct, kw_only=True):
    """A dataset the agent fetched for the trainer: a checked JSON-lines file on local disk."""

    path: str
    sha256: str
    format: str
    rows: int


class TrainerSpec(Struct, kw_only=True):
    """The file the agent writes for `python -m trainer JOB.json`."""

    job: JobId
    attempt: int
    request: "JobRequest"
    out_dir: str
    device: str = "cpu"  # "cuda" (the card is chosen by CUDA_VISIBLE_DEVICES) or "cpu"
    resume_from: str | None = None  # a checkpoint directory
    dataset: DataFile | None = None  # request.dataset, fetched
    validation: DataFile | None = None  # request.validation_dataset, fetched
    token_cache: str | None = None  # where tokenized datasets are kept between jobs; None: in out_dir


class Preparing(Struct, tag="preparing", tag_field="type", kw_only=True):
    """Before the first step: how far the data's preparation is (tokenizing a large file takes minutes)."""

    job: JobId | None = None  # set by the agent when it publishes
    done: int
    total: int
    message: str
    ts: float = 0.0


# What the trainer subprocess prints, one JSON object per line.
class Started(Struct, tag="started", tag_field="type", kw_only=True):
    steps: int
    examples: int
    eval_examples: int = 0
    device: str = "cpu"
    message: str = ""


class Checkpoint(Struct, tag="checkpoint", tag_field="type", kw_only=True):
    step: int
    path: str


class Finished(Struct, tag="finished", tag_field="type", kw_only=True):
    """Training ended with an adapter: `trained` ran to the end, `stopped` was asked to stop early."""

    state: Literal["trained", "stopped"]
    step: int
    adapter_dir: str
    gguf_path: str | None = None
    message: str = ""


class Failed(Struct, tag="failed", tag_field="type", kw_only=True):
    message: str


class Cancelled(Struct, tag="cancelled", tag_field="type", kw_only=True):
    """Not printed by the trainer: how the agent's runner ends a trainer it killed on request."""

    message: str = "cancelled"


JobEvent = Progress | StateChange | Preparing
TrainerEvent = Started | Preparing | Progress | Checkpoint | Finished | Failed
