"""A submitted job checked whole: the rules that span fields or need more than a type, each error naming the field
and the fix; parse_job_request runs them after the schema's own."""

from __future__ import annotations

from collections.abc import Callable

from schemas.graders import Grader
from schemas.jobs import UNEXPORTABLE_TARGETS, JobRequest
from schemas.training import check_training
from schemas.validate import FieldError, parse_all


GraderCheck = Callable[[Grader, str], list[FieldError]]  # services.graders.check: what a grader gets wrong


def check_request(req: JobRequest, grader_check: GraderCheck | None = None) -> list[FieldError]:
    """Rules that span fields or need more than a type: each error says what to change. A grader is checked by
    `grader_check` where the caller has it (the graders are plumbing above the contract: the scheduler passes it)."""
    if req.train.method == "session" or req.session is not None:
        return _session_errors(req)
    errors = _data_errors(req) + _held_out_errors(req) + _schedule_errors(req) + _device_errors(req)
    errors += _adapter_errors(req) + _eval_errors(req)
    if grader_check is not None and req.train.grader is not None:
        errors += grader_check(req.train.grader, "train.grader")
    if grader_check is not None and req.evaluate is not None:
        for n, c in enumerate(req.evaluate.criteria):
            errors += grader_check(c.grader, f"evaluate.criteria.{n}.grader")
    return errors + check_training(req.lora, req.train, req.accelerator, req.quantization, req.served_by)


def _session_errors(req: JobRequest) -> list[FieldError]:
    """A training session (the Tinker API) carries its `session` and no data: its client sends the data call by call."""
    if req.train.method != "session":
        return [FieldError("session", "session is a training session's: set train.method to session or drop it")]
    if req.session is None:
        return [FieldError("session", "train.method session needs its adapter: rank, train_attn, train_mlp...")]
    if not req.session.target_modules():
        return [
            FieldError("session.train_mlp", "train nothing? set at least one of train_attn, train_mlp, train_unembed")
        ]
    errors = []
    if req.data or req.dataset is not None:
        errors.append(FieldError("data", "a session takes its data call by call (forward_backward): drop data"))
    if req.devices > 1 or req.served_by != "vllm" or req.init_adapter is not None:
        errors.append(FieldError("devices", "a session trains on one device, for vLLM, from a fresh adapter"))
    return errors


def _data_errors(req: JobRequest) -> list[FieldError]:
    """The training data: inline or a dataset, exactly one of them."""
    errors = []
    if not req.data and req.dataset is None:
        errors.append(
            FieldError(
                "data",
                'the job has no training data: name a dataset ({"name": ...}, see '
                "`jetlora datasets ls`) or send Q/A pairs inline in data",
            )
        )
    if req.data and req.dataset is not None:
        errors.append(FieldError("data", "give the training data once: inline data or a dataset, not both"))
    return errors


def _held_out_errors(req: JobRequest) -> list[FieldError]:
    """The held-out data, and what needs it (evaluation, early stopping, keeping the best adapter)."""
    errors, t = [], req.train
    if t.eval_steps and not t.eval_fraction and req.validation_dataset is None:
        errors.append(
            FieldError(
                "train.eval_steps",
                "evaluation needs held-out data: set train.eval_fraction (e.g. 0.1), "
                "name a validation_dataset, or set eval_steps to 0",
            )
        )
    if t.eval_fraction and req.validation_dataset is not None:
        errors.append(
            FieldError(
                "train.eval_fraction",
                "the job names a validation_dataset: it is the held-out data; set eval_fraction to 0",
            )
        )
    if t.eval_fraction and req.data and len(req.data) * t.eval_fraction < 1:
        errors.append(
            FieldError(
                "train.eval_fraction",
                f"{t.eval_fraction} of {len(req.data)} examples holds out none; raise it or add data",
            )
        )
    held_out = bool(t.eval_fraction or req.validation_dataset)
    if t.early_stopping_patience and not (held_out and t.eval_steps):
        errors.append(
            FieldError(
                "train.early_stopping_patience",
                "early stopping compares evaluations: set "
                "train.eval_steps and held-out data (train.eval_fraction or validation_dataset)",
            )
        )
    if t.keep_best and not held_out:
        errors.append(
            FieldError(
                "train.keep_best",
                "the best adapter is chosen by eval loss: give held-out data "
                "(train.eval_fraction or validation_dataset) or drop keep_best",
            )
        )
    return errors


def _schedule_errors(req: JobRequest) -> list[FieldError]:
    """The learning-rate schedule against the run's length."""
    errors, t = [], req.train
    if t.max_steps and t.warmup_steps > t.max_steps:
        errors.append(
            FieldError(
                "train.warmup_steps",
                f"{t.warmup_steps} warmup steps is more than the {t.max_steps} "
                "steps of the run; lower it or raise train.max_steps",
            )
        )
    return errors


def _device_errors(req: JobRequest) -> list[FieldError]:
    """What the job asks of the node: its model directory, its devices."""
    errors = []
    if ".." in req.base_dir.split("/"):
        errors.append(FieldError("base_dir", "must not contain '..'; give the model directory's real path"))
    if req.quantization == "nf4" and req.accelerator != "gpu":
        errors.append(
            FieldError(
                "quantization",
                "nf4 loads the base model with bitsandbytes, which needs a GPU: set "
                "accelerator to 'gpu', or quantization to 'none' to train on a CPU",
            )
        )
    if req.devices > 1 and req.accelerator != "gpu":
        errors.append(
            FieldError(
                "devices",
                "a job on several devices runs one rank per GPU of a node (a node offers "
                "its CPU as one device): set accelerator to 'gpu', or devices to 1",
            )
        )
    if req.accelerator == "cpu" and req.gpu_mib:
        errors.append(FieldError("gpu_mib", "a CPU job needs no GPU memory: set gpu_mib to 0 or accelerator to 'gpu'"))
    return errors


def _adapter_errors(req: JobRequest) -> list[FieldError]:
    """The adapter: where it goes in the model, how it starts, what it learns from."""
    errors = []
    targets = req.lora.target_modules
    if len(set(targets)) != len(targets):
        errors.append(FieldError("lora.target_modules", "lists a module twice; name each once"))
    if unexportable := sorted(UNEXPORTABLE_TARGETS & set(targets)):
        errors.append(
            FieldError(
                "lora.target_modules",
                f"{', '.join(unexportable)}: an adapter on the embeddings or the "
                "output head carries a copy of those base weights, which the GGUF export and vLLM "
                "do not take; train the attention and MLP layers instead",
            )
        )
    if req.init_adapter is not None and req.lora.init != "default":
        errors.append(FieldError("lora.init", "the job starts from init_adapter's weights: drop lora.init"))
    if (data := DATASET_OF_METHOD.get(req.train.method)) and (req.data or req.devices > 1):
        errors.append(
            FieldError(
                "data" if req.data else "devices",
                f"{req.train.method} trains on {data} (named in dataset), on one device for now: upload it with "
                "`jetlora datasets put` and name it",
            )
        )
    return errors


DATASET_OF_METHOD = {
    "dpo": "a preference dataset",
    "grpo": "an rft dataset (prompts and the fields its grader reads)",
    "eval": "an rft dataset (the eval's items)",
}


def _eval_errors(req: JobRequest) -> list[FieldError]:
    """An eval run (train.method eval) carries its `evaluate`, and only it does."""
    if req.train.method == "eval" and req.evaluate is None:
        return [FieldError("evaluate", "train.method eval grades an eval's items: run one with `jetlora evals run`")]
    if req.train.method != "eval" and req.evaluate is not None:
        return [FieldError("evaluate", "evaluate is an eval run's: set train.method to eval or drop it")]
    if req.evaluate is not None and req.register is not None:
        return [FieldError("register", "an eval run trains no adapter to register: drop register")]
    if req.register is not None and req.register.gate is not None and not req.register.promote:
        return [
            FieldError(
                "register.gate",
                "a gate decides whether the new version is promoted: set register.promote true, or drop the gate",
            )
        ]
    return []


REQUIRED_PLACEHOLDERS = {"model": "-", "base_dir": "/-", "data": [{"q": "-", "a": "-"}], "dataset": None}


def parse_job_request(data: bytes, grader_check: GraderCheck | None = None) -> JobRequest:
    """A submitted job, or InvalidRequest with every error the schema and the checks find (a grader's too, given
    services.graders.check)."""
    return parse_all(
        data,
        JobRequest,
        lambda req: check_request(req, grader_check),
        REQUIRED_PLACEHOLDERS,
        "send a JSON object with model, base_dir and data or dataset",
    )
