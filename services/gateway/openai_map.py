"""jetlora's jobs, events and checkpoints as OpenAI's objects, and an OpenAI job request as jetlora's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas.events import EventEntry, Preparing, Progress, Samples, StateChange
from schemas.gateway import CheckpointObject, CreateJob, FineTuningJob, GatewayJob, Hyperparameters, JobEventObject
from schemas.gateway import ApiError, ReinforcementHyperparameters
from schemas.graders import Grader
from schemas.jobs import DatasetRef, JobRequest, RegisterSpec
from schemas.job_status import CheckpointInfo, JobSummary
from schemas.training import TrainConfig
from services.gateway.reinforcement import grpo_settings, reinforcement_event, shown_reinforcement

STATUS = {
    "queued": "queued",
    "paused": "paused",
    "assigned": "running",
    "preparing": "running",
    "running": "running",
    "uploading": "running",
    "succeeded": "succeeded",
    "stopped": "succeeded",
    "failed": "failed",
    "cancelled": "cancelled",
}
NATIVE_METHOD = {"supervised": "sft", "dpo": "dpo", "reinforcement": "grpo"}
ADAPTER_NAME_MAX = 128  # a subject token's (schemas.jobs.NodeId)
FINISHED = {"succeeded", "stopped", "failed", "cancelled"}


@dataclass(frozen=True)
class BaseModel:
    """A base model the gateway offers: OpenAI's `model`, the directory nodes have it in, and how jobs on it run."""

    name: str
    base_dir: str
    accelerator: str = "any"
    served_by: str = "vllm"
    save_steps: int = 100  # a checkpoint every this many steps (OpenAI's clients list them)
    reinforcement: dict[str, Any] = field(default_factory=dict)  # native train settings of its reinforcement jobs
    # that OpenAI's API has no place for (max_completion_tokens, temperature, grpo_beta, lr_scheduler...): the
    # operator's (jetlora gateway --reinforcement-train); the request's hyperparameters apply on top


def base_train(model: BaseModel, method: str) -> TrainConfig:
    """A job's native train settings before its hyperparameters: the operator's for reinforcement jobs."""
    settings = model.reinforcement if method == "reinforcement" else {}
    return msgspec.convert({**settings, "method": NATIVE_METHOD[method]}, TrainConfig)


def hyperparameters(req: CreateJob) -> tuple[str, Hyperparameters | ReinforcementHyperparameters]:
    """The method and its hyperparameters, from `method` or the older top-level `hyperparameters`."""
    method = req.method.type if req.method else "supervised"
    settings = getattr(req.method, method, None) if req.method else None
    return method, settings.hyperparameters if settings else (req.hyperparameters or Hyperparameters())


def adapter_name(model: str, suffix: str | None, unique: str) -> str:
    """The registered adapter's name (what engines serve), like OpenAI's ft:model:suffix:id: one subject token of
    at most 128 characters, the model's part shortened to leave room for the whole suffix (up to 64) and `unique`."""
    base = "".join(c if c.isalnum() or c in "_-" else "-" for c in model)
    room = ADAPTER_NAME_MAX - len("ft---") - len(suffix or "") - len(unique[:8])
    return "-".join(p for p in ("ft", base[:room], suffix, unique[:8]) if p)


def job_request(
    req: CreateJob,
    model: BaseModel,
    method: str,
    hp: Hyperparameters | ReinforcementHyperparameters,
    adapter: str,
    seed: int,
    grader: Grader | None = None,
) -> JobRequest:
    """The native request; `grader` is a reinforcement job's (checked by reinforcement_settings)."""
    train = base_train(model, method)
    if isinstance(hp, Hyperparameters) and hp.beta != "auto":
        train.dpo_beta = hp.beta
    if hp.n_epochs != "auto":
        train.epochs = float(hp.n_epochs)
    if hp.batch_size != "auto":
        train.batch_size = hp.batch_size
    if hp.learning_rate_multiplier != "auto":
        train.learning_rate = train.learning_rate * hp.learning_rate_multiplier
    train.seed, train.save_steps = seed, model.save_steps
    if req.validation_file:  # evaluated at each checkpoint, so each checkpoint has its valid_loss
        train.eval_steps = model.save_steps
    if isinstance(hp, ReinforcementHyperparameters):
        assert grader is not None
        grpo_settings(train, hp, grader, train.eval_steps)
    return JobRequest(
        model=model.name,
        base_dir=model.base_dir,
        accelerator=model.accelerator,  # type: ignore[arg-type]
        served_by=model.served_by,  # type: ignore[arg-type]
        dataset=DatasetRef(name=req.training_file),
        validation_dataset=DatasetRef(name=req.validation_file) if req.validation_file else None,
        train=train,
        register=RegisterSpec(name=adapter, promote=True),
        label=req.suffix or "",
    )


def shown_hyperparameters(hp: Hyperparameters | ReinforcementHyperparameters, train: TrainConfig | None = None) -> dict:
    """OpenAI shows the values used: jetlora's defaults where the request said auto."""
    train = train or TrainConfig()
    shown = {
        "n_epochs": hp.n_epochs if hp.n_epochs != "auto" else train.epochs,
        "batch_size": hp.batch_size if hp.batch_size != "auto" else train.batch_size,
        "learning_rate_multiplier": hp.learning_rate_multiplier if hp.learning_rate_multiplier != "auto" else 1.0,
    }
    if train.method == "dpo":
        shown["beta"] = train.dpo_beta
    if isinstance(hp, ReinforcementHyperparameters):
        shown |= shown_reinforcement(hp, train)
    return shown


def fine_tuning_job(
    job: JobSummary, kept: GatewayJob | None, trained_tokens: int | None = None, results: str | None = None
) -> FineTuningJob:
    """OpenAI's job object; `trained_tokens` and the `results` file's id are a succeeded job's. A job preempted (its
    checkpoint stored, queued again to go on from it) is `paused` until it runs again, as a pause is."""
    status = "paused" if job.state == "queued" and job.preempted else STATUS[job.state]
    finished = job.state in FINISHED
    out = FineTuningJob(
        id=job.id,
        created_at=int(job.created),
        model=job.model,
        status=status,  # type: ignore[arg-type]
        training_file=kept.training_file if kept else None,
        validation_file=kept.validation_file if kept else None,
        finished_at=int(job.updated) if finished else None,
    )
    if kept:
        out.model = kept.model  # as asked: a base model, or the fine-tuned model it went on from
        out.seed, out.metadata, out.user_provided_suffix = kept.seed, kept.metadata, kept.suffix
        out.hyperparameters = kept.hyperparameters
        settings: dict = {"hyperparameters": kept.hyperparameters}
        if kept.grader is not None:  # reinforcement's
            settings = {"grader": kept.grader, **settings}
        out.method = {"type": kept.method, kept.method: settings}
        out.fine_tuned_model = kept.fine_tuned_model if status == "succeeded" else None
    if status == "failed":
        out.error = ApiError(message=job.message or "the job failed", type="job_failed", code="job_failed")
    if status == "succeeded":
        out.trained_tokens, out.result_files = trained_tokens, [results] if results else []
    return out


def event_object(entry: EventEntry) -> JobEventObject | None:
    """One of the job's events as OpenAI shows it; None for what OpenAI has no place for (samples)."""
    e, ident = entry.event, f"ftevent-{entry.seq}"
    if isinstance(e, Progress) and e.reinforcement is not None:
        text, data = reinforcement_event(e, e.reinforcement)
        return JobEventObject(id=ident, created_at=int(e.ts), level="info", type="metrics", message=text, data=data)
    if isinstance(e, Progress):
        data = {
            "step": e.step,
            "total_steps": e.steps,
            "train_loss": e.loss,
            "valid_loss": e.eval_loss,
            "tokens": e.tokens,
            "learning_rate": e.lr,
        }
        if e.preference is not None:  # dpo's
            p = e.preference
            data |= {
                "rewards_chosen": p.rewards_chosen,
                "rewards_rejected": p.rewards_rejected,
                "reward_margin": p.margin,
                "reward_accuracy": p.accuracy,
            }
        loss = f"training loss={e.loss:.4f}" if e.loss is not None else "evaluated"
        return JobEventObject(
            id=ident,
            created_at=int(e.ts),
            level="info",
            type="metrics",
            message=f"Step {e.step}/{e.steps}: {loss}",
            data=data,
        )
    if isinstance(e, StateChange):
        text = f"{e.state}" + (f": {e.message}" if e.message else "")
        level = "error" if e.state == "failed" else "warn" if e.state == "cancelled" else "info"
        return JobEventObject(id=ident, created_at=int(e.ts), level=level, message=text)  # type: ignore[arg-type]
    if isinstance(e, Preparing):
        return JobEventObject(id=ident, created_at=int(e.ts), level="info", message=e.message)
    assert isinstance(e, Samples)
    return None


def checkpoint_object(job: str, adapter: str, c: CheckpointInfo) -> CheckpointObject:
    shown = (
        ("step", float(c.step)),
        ("train_loss", c.loss),
        ("valid_loss", c.eval_loss),
        ("full_valid_loss", c.eval_loss),
        ("full_valid_mean_reward", c.eval_reward),  # grpo's, named as OpenAI's RFT events name it
    )
    metrics = {k: v for k, v in shown if v is not None}  # jetlora evaluates the whole validation file each time
    return CheckpointObject(
        id=f"ftckpt-{job}-{c.step}",
        created_at=int(c.created),
        step_number=c.step,
        fine_tuned_model_checkpoint=f"{adapter}:ckpt-step-{c.step}",
        fine_tuning_job_id=job,
        metrics=metrics,
    )
