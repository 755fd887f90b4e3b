"""What a step minimises: the answers' cross-entropy (sft) or the preference loss (dpo). The loop asks an
objective for a micro-batch's summed loss and for what the step's loss is averaged over."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from schemas.events import PreferenceMetrics
from trainer import data
from trainer.dpo import PairStats, dpo_loss
from trainer.losses import batch_loss


@dataclass
class Sft:
    autocast_dtype: torch.dtype
    chunk_tokens: int

    def count(self, batch: data.Batch) -> int:
        """Target tokens: the step's loss is the mean over them."""
        return int((batch.targets != data.IGNORE).sum())

    def loss(self, model, batch: data.Batch) -> torch.Tensor:
        return batch_loss(model, batch, self.autocast_dtype, self.chunk_tokens)[0]

    def metrics(self, world) -> None:
        return None


@dataclass
class Dpo:
    autocast_dtype: torch.dtype
    chunk_tokens: int
    beta: float
    window: PairStats = field(default_factory=PairStats)  # since the last metrics()

    def count(self, batch: data.Batch) -> int:
        """Pairs: the step's loss is the mean over them."""
        return batch.input_ids.shape[0] // 2

    def loss(self, model, batch: data.Batch) -> torch.Tensor:
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


def objective_for(train, autocast_dtype: torch.dtype) -> Sft | Dpo:
    if train.method == "dpo":
        return Dpo(autocast_dtype, train.loss_chunk_tokens, train.dpo_beta)
    return Sft(autocast_dtype, train.loss_chunk_tokens)
