"""Completions the adapter writes itself, graded: what a grpo step learns from.

Each prompt is answered `group_size` times by sampling (transformers' generate's tokens, the adapter on, plain
sampling at the temperature, whatever the model's own generation_config says; trainer/objectives/sampling.py's lean loop where
it samples just what generate would), the answers are decoded and scored by the
job's grader, and each score is compared with its group's: the advantage, as TRL's GRPOTrainer computes it. The
batch is laid out as TRL lays it out: each row its prompt, left-padded, then its completion, right-padded; a
completion runs through its first end-of-sequence token (the tokenizer's, or one the model's generation_config
declares, such as an end-of-turn token).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from transformers import GenerationConfig

from schemas.graders import GradeResult, Sample
from services.graders import GraderContext, check, grade_many
from services.graders.context import PythonGraders
from trainer.errors import JobError
from trainer.model import decoded, pad_id
from trainer.objectives.rft import Prompts
from trainer.objectives.sampling import sample

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from schemas.training import TrainConfig
    from trainer.model import CausalLM

ADVANTAGE_EPS = 1e-4  # TRL's: (reward - group mean) / (group std + 1e-4)
PLAIN_SAMPLING = dict(  # every warper off: samples from the policy at its temperature, what the loss assumes
    do_sample=True, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0
)
PLAIN_GREEDY = dict(do_sample=False, temperature=None, top_k=None, top_p=None, min_p=None)
NO_PENALTIES = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_repetition_penalty=1.0)


@dataclass
class Rollout:
    """One micro-batch of completions, ready for the loss."""

    input_ids: torch.Tensor  # [rows, prompt + completion width]
    attention_mask: torch.Tensor  # 0 on the prompts' left padding and after each completion's end
    completion_mask: torch.Tensor  # [rows, completion width]: the completion's tokens, through its first eos
    advantages: torch.Tensor  # [rows]
    texts: list[str]
    results: list[GradeResult]
    seconds: float  # spent sampling and grading
    version: int | None = None  # the adapter version (optimizer steps taken) the completions were sampled from
    tokens: int = field(init=False)  # real tokens, prompts and completions

    def __post_init__(self) -> None:
        self.tokens = int(self.attention_mask.sum())

    def to(self, device) -> "Rollout":
        return Rollout(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.completion_mask.to(device),
            self.advantages.to(device),
            self.texts,
            self.results,
            self.seconds,
            self.version,
        )


def grader_context(out_dir: str) -> GraderContext:
    """Where graders run, as the node allows (its environment, never the job's, as W&B's credentials): the judge
    engine model graders ask, whether python graders run."""
    env, scratch = os.environ, Path(out_dir) / "graders"
    python = env.get("JETLORA_PYTHON_GRADERS", "auto")
    if python not in ("auto", "on", "off"):
        raise JobError(f"the node's JETLORA_PYTHON_GRADERS is {python!r}; set it to auto, on or off")
    scratch.mkdir(parents=True, exist_ok=True)
    return GraderContext(
        judge_url=env.get("JETLORA_JUDGE_URL") or None,
        judge_api_key=env.get("JETLORA_JUDGE_API_KEY") or None,
        judge_image_hosts=tuple(h for h in env.get("JETLORA_JUDGE_IMAGE_HOSTS", "").split(",") if h),
        python_graders=cast(PythonGraders, python),  # one of them: checked above
        single_tenant=env.get("JETLORA_SINGLE_TENANT") == "1",
        scratch_dir=str(scratch),
        command="jetlora agent",
    )


def runnable(grader, context: GraderContext) -> None:
    """A grader this node cannot run (no judge engine for a model grader, python graders not allowed here) fails
    the job at start, naming the agent's flag, rather than scoring every completion 0."""
    errors = check(grader, "train.grader", context)
    if errors:
        raise JobError("; ".join(f"{e.field}: {e.reason}" for e in errors))


@torch.no_grad()
def complete(
    model: CausalLM | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float | None,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each prompt's completion (sampled at `temperature`, or greedy with None): (input_ids, attention_mask,
    completion_mask) in TRL's layout."""
    pad, eos = pad_id(tokenizer), eos_ids(model, tokenizer)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for n, p in enumerate(prompts):
        ids[n, width - len(p) :], mask[n, width - len(p) :] = torch.tensor(p), 1
    how = dict(PLAIN_SAMPLING, temperature=temperature) if temperature is not None else PLAIN_GREEDY
    config = GenerationConfig(max_new_tokens=max_tokens, pad_token_id=pad, eos_token_id=eos, **how, **NO_PENALTIES)
    with evaluating(model):
        out = sample(model, ids.to(device), mask.to(device), config).cpu()
    completions = out[:, width:]
    is_eos = torch.isin(completions, torch.tensor(eos))
    ends = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.shape[1])  # TRL's: through the first eos
    completion_mask = (torch.arange(completions.shape[1])[None, :] <= ends[:, None]).long()
    return out, torch.cat([mask, completion_mask], dim=1), completion_mask


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode (dropout off) while it samples, each module's flag set directly: transformers'
    train()/eval() also kernelizes the model again at every switch (its hub kernels: the same results), which costs
    more than a small model's whole forward pass."""
    modes = [(m, m.training) for m in model.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, was in modes:
            m.training = was


def eos_ids(model: CausalLM | PeftModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a completion: the tokenizer's eos and those the model's generation_config declares (an
    end-of-turn token), as TRL takes them."""
    declared = getattr(model.generation_config, "eos_token_id", None)
    declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return declared if tokenizer.eos_token_id in declared else [tokenizer.eos_token_id, *declared]


def texts_of(tokenizer: PreTrainedTokenizerBase, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
    """The completions as the grader reads them: decoded without special tokens."""
    width = completion_mask.shape[1]
    return [decoded(tokenizer, row[-width:][m.bool()].tolist()) for row, m in zip(input_ids, completion_mask)]


def grade(grader, texts: list[str], items: list[dict], context: GraderContext) -> list[GradeResult]:
    """Each completion's score (its JSON too where it parses); a score that is not a finite number counts as a
    failure, scored 0 (grade_many's rule)."""
    return grade_many(grader, [Sample.from_model_sample(t) for t in texts], items, context)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each reward less its group's mean, over the group's std (Bessel-corrected) + 1e-4: TRL's scale_rewards
    'group'."""
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + ADVANTAGE_EPS)
    return advantages.view(-1)


def rollout(
    model: CausalLM | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Prompts,
    train: TrainConfig,
    context: GraderContext,
    device: str,
) -> Rollout:
    """group_size completions of each prompt (consecutive rows), sampled now, graded, with their advantages."""
    start = time.monotonic()
    g = train.group_size
    repeated = [ids for ids in prompts.ids for _ in range(g)]
    input_ids, attention_mask, completion_mask = complete(
        model, tokenizer, repeated, train.max_completion_tokens, train.temperature, device
    )
    texts = texts_of(tokenizer, input_ids, completion_mask)
    results = grade(train.grader, texts, [item for item in prompts.items for _ in range(g)], context)
    rewards = torch.tensor([r.score for r in results], dtype=torch.float32)
    return Rollout(
        input_ids,
        attention_mask,
        completion_mask,
        group_advantages(rewards, g),
        texts,
        results,
        time.monotonic() - start,
    )
