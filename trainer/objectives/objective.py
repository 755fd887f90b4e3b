"""What a step minimises: the answers' cross-entropy (sft), the preference loss (dpo), or the policy loss on
completions the adapter samples and a grader scores (grpo). The loop asks an objective for what a step learns from
(grpo's completions are sampled then), a micro-batch's summed loss and what the step's loss is averaged over."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch
from transformers import PreTrainedTokenizerBase

from schemas.events import PreferenceMetrics, ReinforcementMetrics, Sample, Samples, TrainerSpec
from schemas.training import TrainConfig
from services.graders import GraderContext
from trainer.data import examples as data
from trainer.adapter_init import save_plain_lora
from trainer.objectives.engine_rollouts import EngineRollouts
from trainer.errors import JobError
from trainer.objectives.dpo import PairStats, dpo_loss
from trainer.objectives.grpo import grpo_loss
from trainer.objectives.losses import batch_loss
from trainer.objectives.reward_stats import RewardWindow
from trainer.objectives.rft import Prompts
from trainer.objectives.rollouts import Rollout, complete, grade, grader_context, rollout, runnable, texts_of
from trainer.samples import AUTO_PROMPTS

if TYPE_CHECKING:
    from peft import PeftModel

    from schemas.training import LoraConfig
    from trainer.model import AdaptedLM, TrainedAdapter


@dataclass
class Sft:
    autocast_dtype: torch.dtype
    chunk_tokens: int

    def rollout(self, model: AdaptedLM, batches: list, step: int = 0) -> list:
        """What the step learns from: the batches as they are (the data holds the answers)."""
        return batches

    def count(self, batch: data.Batch) -> int:
        """Target tokens: the step's loss is the mean over them."""
        return int((batch.targets != data.IGNORE).sum())

    def loss(self, model: AdaptedLM, batch: data.Batch) -> torch.Tensor:
        return batch_loss(model, batch, self.autocast_dtype, self.chunk_tokens)[0]

    def metrics(self, world) -> None:
        return None


@dataclass
class Dpo:
    autocast_dtype: torch.dtype
    chunk_tokens: int
    beta: float
    window: PairStats = field(default_factory=PairStats)  # since the last metrics()

    def rollout(self, model: AdaptedLM, batches: list, step: int = 0) -> list:
        """What the step learns from: the pairs as they are."""
        return batches

    def count(self, batch: data.Batch) -> int:
        """Pairs: the step's loss is the mean over them."""
        return batch.input_ids.shape[0] // 2

    def loss(self, model: AdaptedLM, batch: data.Batch) -> torch.Tensor:
        loss, stats = dpo_loss(model, batch, self.beta, self.autocast_dtype, self.chunk_tokens)
        if model.training:
            self.window.add(stats)
        return loss

    def metrics(self, world) -> PreferenceMetrics | None:
        """The rewards over the pairs trained on since the last call (every rank's)."""
        pairs, chosen, rejected, correct = world.sum(
            self.window.pairs, self.window.chosen, self.window.rejected, self.window.correct
        )
        self.window = PairStats()
        if not pairs:
            return None
        return PreferenceMetrics(
            rewards_chosen=chosen / pairs,
            rewards_rejected=rejected / pairs,
            margin=(chosen - rejected) / pairs,
            accuracy=correct / pairs,
        )


@dataclass
class Grpo:
    autocast_dtype: torch.dtype
    chunk_tokens: int
    train: TrainConfig  # the job's: the grader, group_size, temperature, beta, epsilon...
    tokenizer: PreTrainedTokenizerBase
    device: str
    context: GraderContext  # where graders run
    engine: EngineRollouts | None = None  # train.rollouts engine (or auto, with an engine): the node's vLLM samples
    window: RewardWindow = field(init=False)  # since the last metrics()
    versions: set[int] = field(default_factory=set)  # the adapter versions sampled from since the last metrics()

    def __post_init__(self) -> None:
        self.window = RewardWindow(self.train.grader)

    def rollout(self, model: PeftModel, batches: list, step: int = 0) -> list[Rollout]:
        """What the step learns from: each micro-batch's prompts answered now by the adapter as it is after `step`
        optimizer steps (the trainer's, or the engine's copy of it), and graded."""
        batches = [p for p in batches if p]
        if self.engine is not None:
            out = self.engine.rollouts(model, batches, step)
        else:
            out = [rollout(model, self.tokenizer, p, self.train, self.context, self.device) for p in batches]
        for batch in out:
            batch.version = step if batch.version is None else batch.version
            self.versions.add(batch.version)
            self.window.add(batch)
        return out

    def count(self, batch: Rollout) -> int:
        """Completion tokens: the step's loss is the mean over them (TRL's loss_type dapo)."""
        return int(batch.completion_mask.sum())

    def loss(self, model: AdaptedLM, batch: Rollout) -> torch.Tensor:
        t = self.train
        loss, kl = grpo_loss(
            model, batch, t.grpo_beta, t.grpo_epsilon, t.temperature, self.autocast_dtype, self.chunk_tokens
        )
        self.window.kl += kl
        return loss

    def metrics(self, world) -> ReinforcementMetrics | None:
        """The rewards of the completions graded since the last call (one device: the request's checks)."""
        metrics = self.window.report(with_kl=self.train.grpo_beta > 0)
        self.window = RewardWindow(self.train.grader)
        versions, self.versions = sorted(self.versions), set()
        if metrics is None:
            return None
        engine = self.engine.report() if self.engine is not None else {}
        return msgspec.structs.replace(metrics, sampled_from=versions, **engine)

    @torch.no_grad()
    def evaluate(self, model: PeftModel, batches: list[Prompts], step: int) -> tuple[float, Samples]:
        """The mean score of the held-out prompts' greedy answers, and the first few of them, scored."""
        t, shown = self.train, []
        for prompts in batches:
            ids, _, completion_mask = complete(
                model, self.tokenizer, prompts.ids, t.max_completion_tokens, None, self.device
            )
            answers = texts_of(self.tokenizer, ids, completion_mask)
            results = grade(t.grader, answers, prompts.items, self.context)
            shown += [Sample(p, a, r.score) for p, a, r in zip(prompts.shown, answers, results)]
        mean = sum(s.score or 0.0 for s in shown) / max(len(shown), 1)
        return mean, Samples(step=step, model="adapter", samples=shown[:AUTO_PROMPTS])


def objective_for(
    spec: TrainerSpec,
    tokenizer: PreTrainedTokenizerBase,
    device: str,
    autocast_dtype: torch.dtype,
    initial: dict[str, torch.Tensor] | None = None,
) -> Sft | Dpo | Grpo:
    """The job's method; grpo's completions sampled by the node's vLLM where train.rollouts asks for it (`initial`:
    the adapter's start where it moved part of the base, so that the engine gets a plain LoRA)."""
    train = spec.request.train
    if train.method == "grpo":
        context = grader_context(spec.out_dir)
        runnable(train.grader, context)
        engine = rollout_engine(spec, tokenizer, device, context, initial)
        return Grpo(autocast_dtype, train.loss_chunk_tokens, train, tokenizer, device, context, engine)
    return token_objective(train, autocast_dtype)


def token_objective(train: TrainConfig, autocast_dtype: torch.dtype) -> Sft | Dpo:
    """sft's or dpo's objective: what a step learns from is the data's own tokens (a co-training group's too)."""
    if train.method == "dpo":
        return Dpo(autocast_dtype, train.loss_chunk_tokens, train.dpo_beta)
    return Sft(autocast_dtype, train.loss_chunk_tokens)


def rollout_engine(
    spec: TrainerSpec,
    tokenizer: PreTrainedTokenizerBase,
    device: str,
    context: GraderContext,
    initial: dict[str, torch.Tensor] | None,
) -> EngineRollouts | None:
    """Who samples grpo's completions: the node's vLLM (train.rollouts engine, or auto where the agent found one),
    else the trainer; engine where the node has none is a JobError saying why."""
    train, engine = spec.request.train, spec.rollout_engine
    if train.rollouts == "trainer" or (engine is None and train.rollouts == "auto"):
        return None
    if engine is None:
        raise JobError(
            f"train.rollouts is engine, but {spec.no_rollout_engine or 'the agent named no vLLM engine'}: run the "
            "job on a node with one (the job's `node`), or set train.rollouts to auto or trainer"
        )
    save = functools.partial(_save_plain, initial=initial, lora=spec.request.lora)
    return EngineRollouts(engine, spec, tokenizer, device, save, context, strict=train.rollouts == "engine")


def _save_plain(model: TrainedAdapter, out: Path, initial: dict[str, torch.Tensor] | None, lora: LoraConfig) -> Path:
    return save_plain_lora(model, out, initial, lora)
