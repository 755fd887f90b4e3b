"""How a job trains: the adapter's shape and initialisation, the optimizer and the usual SFT knobs, and the rules
between them that a type alone cannot say."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from schemas.graders import Grader
from schemas.validate import FieldError, pattern

MODULE_NAME = pattern(
    r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
    "must be the name of a linear layer, such as q_proj or down_proj (letters, digits, '_')",
)
SEED_MAX = 2**32 - 1  # numpy's and torch's seeds are 32-bit
STEPS_MAX = 100_000_000
ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
MUTATING_INITS = ("pissa", "loftq")  # they change the base's weights: the adapter is saved as a plain LoRA of 2r
GRPO_FIELDS = (
    "group_size",
    "max_completion_tokens",
    "temperature",
    "grpo_beta",
    "grpo_epsilon",
    "eval_samples",
    "rollouts",
)


class LoftQ(Struct, forbid_unknown_fields=True, kw_only=True):
    """LoftQ's settings (peft's LoftQConfig)."""

    bits: Annotated[Literal[4, 8], Meta(description="the quantisation LoftQ initialises against: nf4 or int8")] = 4
    iterations: Annotated[int, Meta(ge=1, le=16, description="alternating quantise/SVD rounds per layer")] = 1


class LoraConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """The adapter's shape."""

    r: Annotated[int, Meta(ge=1, le=1024)] = 16
    alpha: Annotated[float, Meta(gt=0, le=8192)] = 32.0
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    target_modules: Annotated[list[Annotated[str, Meta(pattern=MODULE_NAME)]], Meta(min_length=1, max_length=64)] = (
        field(default_factory=lambda: list(ATTENTION_AND_MLP))
    )
    rslora: bool = False
    init: Annotated[
        Literal["default", "gaussian", "pissa", "loftq"],
        Meta(
            description=(
                "how A and B start (peft's initialisers): default (A Kaiming-uniform, B zero), gaussian (A normal), pissa "
                "(the principal singular vectors of each weight; one SVD per layer at start), loftq (against the base's "
                "weights quantised in memory; GPU only). pissa and loftq change the base's weights while training, so "
                "their adapter is stored as a plain LoRA of rank 2r on the original base, which llama.cpp and vLLM serve"
            )
        ),
    ] = "default"
    loftq: LoftQ = field(default_factory=LoftQ)


Optimizer = Literal["adamw", "adamw_8bit", "adafactor", "sgd"]


class TrainConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """How to train: the usual SFT knobs, with the defaults a user expects."""

    epochs: Annotated[float, Meta(gt=0, le=1000)] = 1.0
    max_steps: Annotated[int, Meta(ge=0, le=STEPS_MAX, description="0: as many steps as the epochs take")] = 0
    learning_rate: Annotated[float, Meta(gt=0, le=1)] = 2e-4
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "cosine"
    warmup_steps: Annotated[int, Meta(ge=0, le=STEPS_MAX, description="wins over warmup_ratio when > 0")] = 0
    warmup_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.03
    optimizer: Annotated[
        Optimizer,
        Meta(
            description=(
                "adamw (torch), adamw_8bit (bitsandbytes, its two moments in 8 bits; GPU only), adafactor (transformers, "
                "factored second moments, no first), sgd (torch; with momentum if set)"
            )
        ),
    ] = "adamw"
    adam_betas: Annotated[
        tuple[Annotated[float, Meta(ge=0, lt=1)], Annotated[float, Meta(ge=0, lt=1)]],
        Meta(description="adamw and adamw_8bit's beta1, beta2"),
    ] = ADAM_BETAS
    adam_eps: Annotated[float, Meta(gt=0, le=1, description="adamw and adamw_8bit's epsilon")] = ADAM_EPS
    momentum: Annotated[float, Meta(ge=0, lt=1, description="sgd's momentum (0: none)")] = 0.0
    weight_decay: Annotated[float, Meta(ge=0, le=10)] = 0.0
    batch_size: Annotated[int, Meta(ge=1, le=4096, description="rows per micro-batch")] = 4
    grad_accum: Annotated[int, Meta(ge=1, le=4096)] = 1
    max_seq_length: Annotated[int, Meta(ge=8, le=262144)] = 1024
    seed: Annotated[int, Meta(ge=0, le=SEED_MAX)] = 42
    completions_only: Annotated[bool, Meta(description="the loss covers the answers, not the questions")] = True
    packing: Annotated[bool, Meta(description="padding-free packing of several examples per row")] = True
    eval_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    eval_steps: Annotated[int, Meta(ge=0, le=STEPS_MAX, description="0: evaluate at the end only")] = 0
    save_steps: Annotated[int, Meta(ge=0, le=STEPS_MAX, description="checkpoint every N steps; 0: never")] = 0
    logging_steps: Annotated[int, Meta(ge=1, le=STEPS_MAX)] = 1
    gradient_checkpointing: bool = False
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    max_grad_norm: Annotated[float, Meta(ge=0, le=1e4, description="0: no clipping")] = 1.0
    loss_chunk_tokens: Annotated[
        int,
        Meta(
            ge=0,
            le=1_048_576,
            description=(
                "the loss goes through the output projection this many tokens at a time, so peak memory does not grow "
                "with tokens x vocabulary; 0: all tokens at once"
            ),
        ),
    ] = 1024
    early_stopping_patience: Annotated[
        int,
        Meta(
            ge=0,
            le=10_000,
            description=(
                "end the run (as succeeded) after this many evaluations in a row without the eval loss improving by "
                "early_stopping_min_delta; 0: never"
            ),
        ),
    ] = 0
    early_stopping_min_delta: Annotated[float, Meta(ge=0, le=100)] = 0.0
    keep_best: (
        Annotated[
            bool,
            Meta(
                description=(
                    "the final adapter is the one of the best evaluation, not the last step's; default: true when there is "
                    "held-out data"
                )
            ),
        ]
        | None
    ) = None
    sample_prompts: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=4000)]] | Literal["auto"],
        Meta(
            description="prompts answered (greedy) at each evaluation and at the end; auto: the first 3 held-out "
            "examples' prompts"
        ),
    ] = field(default_factory=list)
    sample_max_tokens: Annotated[int, Meta(ge=1, le=1024)] = 48
    method: Annotated[
        Literal["sft", "dpo", "grpo", "eval", "session"],
        Meta(
            description=(
                "sft: learn the answers (chat, qa, alpaca or text data); dpo: prefer one answer to another (preference "
                "data), the base model with the adapter switched off being the reference; grpo: reinforcement from the "
                "grader's scores of completions the adapter samples itself (rft data); eval: train nothing, sample and grade an "
                "eval's items with the adapter (or the base) and store the results (an eval run: `jetlora evals run`); session: "
                "a trainer that stays up and takes calls (the Tinker API: forward_backward, optim_step, sample...)"
            )
        ),
    ] = "sft"
    dpo_beta: Annotated[
        float,
        Meta(
            gt=0, le=10, description=("dpo's beta: how strongly the adapter is held to the reference (higher: closer)")
        ),
    ] = 0.1
    grader: Annotated[
        Grader | None, Meta(description="grpo's: OpenAI's grader JSON, scoring each completion (the row is its item)")
    ] = None
    group_size: Annotated[
        int, Meta(ge=2, le=256, description="grpo: completions sampled per prompt, compared within their group")
    ] = 4
    max_completion_tokens: Annotated[
        int, Meta(ge=1, le=32768, description="grpo: the most tokens a sampled completion has")
    ] = 64
    temperature: Annotated[
        float, Meta(gt=0, le=10, description="grpo: the sampling temperature of completions (and of their log-probs)")
    ] = 1.0
    grpo_beta: Annotated[
        float,
        Meta(ge=0, le=10, description="grpo: the KL coefficient against the reference; 0 (TRL's default): no KL term"),
    ] = 0.0
    grpo_epsilon: Annotated[
        float, Meta(gt=0, lt=1, description="grpo: the ratio is clipped to [1 - epsilon, 1 + epsilon]")
    ] = 0.2
    eval_samples: Annotated[
        int, Meta(ge=1, le=100_000, description="grpo: held-out prompts answered and graded at each evaluation")
    ] = 16
    rollouts: Annotated[
        Literal["trainer", "engine", "auto"],
        Meta(
            description=(
                "grpo: who samples the completions. trainer: the trainer itself (transformers' generate); engine: the "
                "node's co-located vLLM (the adapter synced into it after every step under a name of the job's own, "
                "at a lower priority than live traffic where the engine schedules by priority): a node without one "
                "fails the job saying so, so pin it with `node`; auto: the node's vLLM where it has one, else the "
                "trainer"
            )
        ),
    ] = "trainer"


def check_training(
    lora: LoraConfig, t: TrainConfig, accelerator: str, quantization: str, served_by: str
) -> list[FieldError]:
    """The initialiser and optimizer rules: what needs a GPU, what a setting does not apply to."""
    errors = method_errors(t)
    if t.optimizer == "adamw_8bit" and accelerator != "gpu":
        errors.append(
            FieldError(
                "train.optimizer",
                "adamw_8bit is bitsandbytes' optimizer, which needs a GPU: set "
                "accelerator to 'gpu', or choose adamw to train on a CPU",
            )
        )
    if t.momentum and t.optimizer != "sgd":
        errors.append(
            FieldError(
                "train.momentum",
                f"momentum is sgd's; {t.optimizer} does not take it: set train.optimizer to 'sgd' or momentum to 0",
            )
        )
    if (t.adam_betas != ADAM_BETAS or t.adam_eps != ADAM_EPS) and t.optimizer not in ("adamw", "adamw_8bit"):
        where = "train.adam_betas" if t.adam_betas != ADAM_BETAS else "train.adam_eps"
        errors.append(
            FieldError(
                where,
                f"{where} applies to adamw and adamw_8bit, not {t.optimizer}: drop it or choose an AdamW optimizer",
            )
        )
    if lora.init == "loftq" and accelerator != "gpu":
        errors.append(
            FieldError(
                "lora.init",
                "loftq quantises the base's weights with bitsandbytes on a GPU: set "
                "accelerator to 'gpu', or choose pissa or default to train on a CPU",
            )
        )
    if lora.init in MUTATING_INITS and quantization != "none":
        errors.append(
            FieldError(
                "lora.init",
                f"{lora.init} starts from the full-precision weights (LoftQ is itself "
                "the quantisation-aware start): set quantization to 'none'",
            )
        )
    if lora.init in MUTATING_INITS and 2 * lora.r > 512 and served_by == "vllm":
        errors.append(
            FieldError(
                "lora.r",
                f"a {lora.init} adapter is stored with rank 2r = {2 * lora.r}, above the "
                "512 vLLM serves; lower lora.r to 256 or less",
            )
        )
    return errors


def method_errors(t: TrainConfig) -> list[FieldError]:
    """What each method takes: dpo a step of pairs, grpo a grader and room for its completions; grpo's settings
    on no other method."""
    errors = []
    if t.method == "dpo" and t.grad_accum != 1:
        errors.append(FieldError("train.grad_accum", "dpo takes train.batch_size pairs per step: set grad_accum to 1"))
    if t.method == "grpo" and t.grader is None:
        errors.append(
            FieldError(
                "train.grader",
                "grpo learns from a grader's scores: give one (OpenAI's grader JSON, e.g. "
                '{"type": "string_check", "name": "has_answer", "input": "{{sample.output_text}}", '
                '"reference": "{{item.answer}}", "operation": "like"})',
            )
        )
    if t.method != "grpo" and t.grader is not None:
        errors.append(
            FieldError("train.grader", "a grader scores grpo's completions: set train.method to grpo or drop it")
        )
    if t.method == "grpo" and t.max_completion_tokens >= t.max_seq_length:
        errors.append(
            FieldError(
                "train.max_completion_tokens",
                f"{t.max_completion_tokens} completion tokens leave no room for the prompt in train.max_seq_length "
                f"{t.max_seq_length}: lower it or raise max_seq_length",
            )
        )
    if t.method != "grpo":
        defaults = TrainConfig()
        errors += [
            FieldError(
                f"train.{name}",
                f"train.{name} is grpo's; {t.method} does not take it: drop it or set train.method to grpo",
            )
            for name in GRPO_FIELDS
            if getattr(t, name) != getattr(defaults, name)
        ]
    return errors
