"""The OpenAI-compatible gateway's wire shapes: OpenAI's own (files, fine-tuning jobs, events, checkpoints,
errors), and the records the gateway keeps (API keys, and what a job was created with)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from schemas.jobs import DatasetName, JobId, NodeId, TenantId
from schemas.validate import pattern

Auto = Literal["auto"]
JobStatus = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]


class KeyRecord(Struct, kw_only=True):
    """An API key as stored: its tenant and the sha256 of its secret (the key itself is shown once, at creation)."""

    id: Annotated[str, Meta(pattern=r"^[a-f0-9]{16}$")]
    tenant: TenantId
    secret_sha256: str
    created: float
    label: str = ""


class Hyperparameters(Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's supervised hyperparameters; "auto" means jetlora's default."""

    n_epochs: Annotated[int, Meta(ge=1, le=50)] | Auto = "auto"
    batch_size: Annotated[int, Meta(ge=1, le=256)] | Auto = "auto"
    learning_rate_multiplier: Annotated[float, Meta(gt=0, le=1000)] | Auto = "auto"
    beta: Annotated[float, Meta(gt=0, le=2)] | Auto = "auto"  # dpo only


class MethodSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    hyperparameters: Hyperparameters = field(default_factory=Hyperparameters)


class ReinforcementHyperparameters(Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's ReinforcementHyperparameters; "auto" means jetlora's default (the README maps each to grpo's)."""

    n_epochs: Annotated[int, Meta(ge=1, le=1000)] | Auto = "auto"
    batch_size: Annotated[int, Meta(ge=1, le=256)] | Auto = "auto"
    learning_rate_multiplier: Annotated[float, Meta(gt=0, le=1000)] | Auto = "auto"
    compute_multiplier: Annotated[float, Meta(gt=0, le=64)] | Auto = "auto"  # completions per prompt: 4x it
    eval_interval: Annotated[int, Meta(ge=1, le=1_000_000)] | Auto = "auto"
    eval_samples: Annotated[int, Meta(ge=1, le=100_000)] | Auto = "auto"
    reasoning_effort: str | None = None  # the fleet's models do not reason: only "default" (or "auto") is taken


class ReinforcementSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's ReinforcementMethod: the grader stays JSON here, so that every error in it is named by its path."""

    grader: dict[str, Any]
    hyperparameters: ReinforcementHyperparameters = field(default_factory=ReinforcementHyperparameters)


class Method(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["supervised", "dpo", "reinforcement"] = "supervised"
    supervised: MethodSettings | None = None
    dpo: MethodSettings | None = None
    reinforcement: ReinforcementSettings | None = None


class CreateJob(Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/fine_tuning/jobs, as OpenAI documents it."""

    model: Annotated[str, Meta(min_length=1, max_length=200)]
    training_file: Annotated[str, Meta(min_length=1, max_length=200)]
    validation_file: str | None = None
    suffix: (
        Annotated[
            str,
            Meta(
                pattern=pattern(
                    r"^[A-Za-z0-9_-]{1,64}$",
                    "must be 1-64 letters, digits, '_' or '-' (it becomes part of the fine-tuned model's name)",
                )
            ),
        ]
        | None
    ) = None
    seed: Annotated[int, Meta(ge=0, le=2_147_483_647)] | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=16)] | None = None
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    integrations: list[Any] | None = None  # accepted and ignored, as a self-hosted fleet has none of OpenAI's


class GatewayJob(Struct, kw_only=True):
    """What the gateway remembers of a job it created: what OpenAI's job object shows and jetlora's does not."""

    job: JobId
    tenant: TenantId
    model: str
    training_file: DatasetName
    validation_file: DatasetName | None = None
    suffix: str | None = None
    seed: int
    metadata: dict[str, str] | None = None
    method: Literal["supervised", "dpo", "reinforcement"] = "supervised"
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    grader: dict[str, Any] | None = None  # a reinforcement job's, as the client sent it
    fine_tuned_model: NodeId
    created: float
    eval_steps: int = 0  # the job's train.eval_steps (0: evaluated at the end only): where its valid_loss was measured


class ApiError(Struct, kw_only=True):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorBody(Struct):
    error: ApiError


class FileObject(Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    object: str = "file"
    purpose: str = "fine-tune"
    status: str = "processed"
    status_details: str | None = None


class FineTuningJob(Struct, kw_only=True):
    id: JobId
    created_at: int
    model: str
    status: JobStatus
    training_file: str | None
    validation_file: str | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    metadata: dict[str, str] | None = None
    method: dict[str, Any] | None = None
    error: ApiError | None = None
    trained_tokens: int | None = None
    result_files: list[str] = field(default_factory=list)
    estimated_finish: int | None = None
    integrations: list[Any] = field(default_factory=list)
    organization_id: str = ""
    user_provided_suffix: str | None = None
    object: str = "fine_tuning.job"


class JobEventObject(Struct, kw_only=True):
    id: str
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"] = "message"
    data: dict[str, Any] | None = None
    object: str = "fine_tuning.job.event"


class CheckpointObject(Struct, kw_only=True):
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: JobId
    metrics: dict[str, float]
    step_number: int
    object: str = "fine_tuning.job.checkpoint"


class Page(Struct, kw_only=True):
    data: list[Any]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
    object: str = "list"


class ModelObject(Struct, kw_only=True):
    id: str
    created: int
    owned_by: str
    object: str = "model"


class ModelDeleted(Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: str = "model"


class GraderRunErrors(Struct, kw_only=True):
    """OpenAI's metadata.errors of a grader run: which kind of failure made the reward 0 (`message`, jetlora's,
    says what it was)."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False
    message: str | None = None


class GraderRunMetadata(Struct, kw_only=True):
    errors: GraderRunErrors
    execution_time: float
    name: str
    type: str
    scores: dict[str, Any] = field(default_factory=dict)
    sampled_model_name: str | None = None
    token_usage: int | None = None


class GraderRunResponse(Struct, kw_only=True):
    """POST /v1/fine_tuning/alpha/graders/run's answer."""

    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, Any] = field(default_factory=dict)
    model_grader_token_usage_per_model: dict[str, Any] = field(default_factory=dict)
