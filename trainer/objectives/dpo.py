"""Direct preference optimisation (Rafailov et al., 2023), as TRL's DPOTrainer computes its sigmoid loss.

A batch holds B pairs as 2B rows, the chosen answers first and the rejected after them, each learnt only over its
answer. The reference is the base model itself, the adapter switched off (peft's adapter layers disabled), so no second
copy of the weights is held; a job that starts from a registered adapter (dpo after sft) keeps that adapter as it
started, frozen, as the reference (a second LoRA, not a second model). For each pair, with log-probabilities summed over the answer's tokens:

    reward(answer) = beta * (log p_adapter(answer) - log p_reference(answer))
    loss = -log sigmoid(reward(chosen) - reward(rejected))
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from peft import PeftModel

from trainer.objectives.chunked_loss import chunked_cross_entropy
from trainer.data.examples import IGNORE, Batch
from trainer.objectives.losses import OutputHead, output_head

if TYPE_CHECKING:
    from trainer.model import AdaptedLM


REFERENCE = "ref"  # the frozen starting adapter's name in the peft model, where the job started from one


@contextmanager
def reference(model: AdaptedLM) -> Iterator[None]:
    """The model as the reference: the frozen starting adapter active, or the adapter switched off."""
    if not isinstance(model, PeftModel) or REFERENCE not in model.peft_config:
        model.base_model.disable_adapter_layers()  # peft's disable_adapter() less its survey of every layer's state
        try:
            yield
        finally:
            model.base_model.enable_adapter_layers()
        return
    model.set_adapter(REFERENCE)  # peft makes the active adapter trainable: the trained one is made so again after
    try:
        yield
    finally:
        model.set_adapter("default")


def sequence_logps(model: AdaptedLM, batch: Batch, autocast_dtype, chunk_tokens: int) -> torch.Tensor:
    """Each row's log-probability of its learnt tokens, summed: [rows]."""
    head = output_head(model) if chunk_tokens else None
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    with torch.autocast(
        device_type=batch.input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32
    ):
        out = head.decoder(**inputs).last_hidden_state if head else model(**inputs).logits
    return logps_of(out, head, batch.targets, chunk_tokens)


def logps_of(out: torch.Tensor, head: OutputHead | None, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Each row's summed log-probability of its learnt tokens from the model's output (the last hidden state
    through `head`, or the logits where head is None): [rows]."""
    if head:  # a row at a time through the chunked projection: no [rows x length x vocab] logits
        return torch.stack(
            [
                -chunked_cross_entropy(out[i], head.weight, targets[i], chunk_tokens, head.scale)
                for i in range(out.shape[0])
            ]
        )
    losses = F.cross_entropy(out.float().transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
    return -losses.sum(dim=-1)


@dataclass
class PairStats:
    """Sums over pairs, so that steps and ranks add up before dividing."""

    pairs: int = 0
    chosen: float = 0.0
    rejected: float = 0.0
    correct: float = 0.0

    def add(self, other: "PairStats") -> None:
        self.pairs += other.pairs
        self.chosen += other.chosen
        self.rejected += other.rejected
        self.correct += other.correct


def dpo_loss(
    model: AdaptedLM, batch: Batch, beta: float, autocast_dtype, chunk_tokens: int
) -> tuple[torch.Tensor, PairStats]:
    """The batch's summed pair losses (divide by the pairs of the step), and its rewards."""
    policy = sequence_logps(model, batch, autocast_dtype, chunk_tokens)
    with torch.no_grad(), reference(model):
        referenced = sequence_logps(model, batch, autocast_dtype, chunk_tokens)
    return preference_loss(policy, referenced, beta)


def preference_loss(policy: torch.Tensor, referenced: torch.Tensor, beta: float) -> tuple[torch.Tensor, PairStats]:
    """The summed sigmoid loss of pairs from each row's log-probability under the adapter and the reference (the
    chosen rows first, the rejected after them), and the pairs' rewards."""
    policy_chosen, policy_rejected = policy.chunk(2)
    ref_chosen, ref_rejected = referenced.chunk(2)
    chosen, rejected = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
    losses = -F.logsigmoid(chosen - rejected)
    chosen, rejected = chosen.detach(), rejected.detach()
    return losses.sum(), PairStats(
        len(losses), float(chosen.sum()), float(rejected.sum()), float((chosen > rejected).sum())
    )
