"""jetlora's words in a service's message turned into the OpenAI request's: its field names (`training_file`,
`method.type`, `model`, `hyperparameters.n_epochs`, ...), its objects (files, fine-tuned models) and its
endpoints in place of `jetlora` commands, so a client of the API is never told to fix what it cannot see."""

from __future__ import annotations

import re

FIELD_PARAMS = {  # jetlora's field (a prefix of it) -> OpenAI's parameter
    "validation_dataset": "validation_file",
    "dataset": "training_file",
    "model": "model",
    "train.seed": "seed",
    "train.epochs": "hyperparameters.n_epochs",
    "train.batch_size": "hyperparameters.batch_size",
    "train.learning_rate": "hyperparameters.learning_rate_multiplier",
    "train.dpo_beta": "hyperparameters.beta",
    "train.grader": "method.reinforcement.grader",
    "train.group_size": "method.reinforcement.hyperparameters.compute_multiplier",
    "train.eval_samples": "method.reinforcement.hyperparameters.eval_samples",
    "train.eval_steps": "method.reinforcement.hyperparameters.eval_interval",
    "train.method": "method.type",
    "register.name": "suffix",
    "init_adapter": "model",
}

_WORDS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(p), r)
    for p, r in (
        # commands first, while their words are still jetlora's
        (r"`jetlora adapters (?:ls|list)`", "GET /v1/models"),
        (r"`jetlora adapters show ([^`]+)`", r"GET /v1/models/\1"),
        (r"`jetlora datasets ls`", "GET /v1/files"),
        (r"`jetlora datasets put [^`]*`", "POST /v1/files"),
        (r"`jetlora jobs`", "GET /v1/fine_tuning/jobs"),
        (r"`jetlora (resume|pause|cancel) ([^`]+)`", r"POST /v1/fine_tuning/jobs/\2/\1"),
        (r"an admin shares one with POST /v1/files", "upload it with POST /v1/files"),
        # fields
        (r"; name one with init_adapter\.version", "; GET /v1/models lists the fine-tuned models that serve one"),
        (r"\binit_adapter(?:\.name|\.version)?\b", "model"),
        (r"\bvalidation_dataset(?:\.name)?\b", "validation_file"),
        (r"\bdataset\.name\b", "training_file"),
        (r"\(named in dataset\)", "(named in training_file)"),
        (r"\bregister\.name\b", "suffix"),
        (r"\btrain\.epochs\b", "hyperparameters.n_epochs"),
        (r"\btrain\.batch_size\b", "hyperparameters.batch_size"),
        (r"\btrain\.learning_rate\b", "hyperparameters.learning_rate_multiplier"),
        (r"\btrain\.dpo_beta\b", "hyperparameters.beta"),
        (r"\btrain\.seed\b", "seed"),
        (r"\btrain\.method\b", "method.type"),
        (r"\btrain\.grader\b", "method.reinforcement.grader"),
        (r"\btrain\.group_size\b", "method.reinforcement.hyperparameters.compute_multiplier"),
        (r"\btrain\.eval_samples\b", "method.reinforcement.hyperparameters.eval_samples"),
        (r"\btrain\.eval_steps\b", "method.reinforcement.hyperparameters.eval_interval"),
        (r"\bgrpo\b", "reinforcement"),
        (r" \(see schemas/json/ for the fields\)", ""),
        # objects
        (r"\ba preference dataset\b", "a file of preference pairs"),
        (r"\bdatasets\b", "files"),
        (r"\bdataset\b", "file"),
        (r"\badapter name\b", "fine-tuned model name"),
        (r"\bchoose another name\b", "choose another suffix"),
        (r"\badapters\b", "fine-tuned models"),
        (r"\badapter\b", "fine-tuned model"),
    )
]


def openai_terms(text: str) -> str:
    for pattern, replacement in _WORDS:
        text = pattern.sub(replacement, text)
    return text


def param_of(field: str) -> str | None:
    """OpenAI's parameter for a jetlora field; the field itself where there is none."""
    return next((p for f, p in FIELD_PARAMS.items() if field.startswith(f)), field or None)
