"""The supervised loss: cross-entropy over a batch's target tokens, through the output projection a chunk of
tokens at a time where the model's head allows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.data import examples as data
from trainer.objectives.chunked_loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from trainer.model import base_of

if TYPE_CHECKING:
    from trainer.model import AdaptedLM


def batch_loss(
    model: AdaptedLM, batch: data.Batch, autocast_dtype, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the batch's target tokens, and how many there were. With chunk_tokens, through
    the output projection a chunk at a time (same loss, same gradients, a fraction of the peak memory)."""
    head = output_head(model) if chunk_tokens else None
    inputs = dict(
        input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask, use_cache=False
    )
    targets = batch.targets.reshape(-1)
    with torch.autocast(
        device_type=batch.input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32
    ):
        out = head.decoder(**inputs).last_hidden_state if head else model(**inputs).logits
    return targets_loss(out, head, targets, chunk_tokens), int((targets != data.IGNORE).sum())


def targets_loss(
    out: torch.Tensor, head: "OutputHead | None", targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Summed cross-entropy of the model's output (the last hidden state through `head`, or the logits where head
    is None) against flat `targets`."""
    if head:
        return chunked_cross_entropy(out.reshape(-1, out.shape[-1]), head.weight, targets, chunk_tokens, head.scale)
    return torch.nn.functional.cross_entropy(
        out.float().reshape(-1, out.shape[-1]), targets, ignore_index=data.IGNORE, reduction="sum"
    )


@dataclass
class OutputHead:
    decoder: torch.nn.Module  # the model up to its last hidden state
    weight: torch.Tensor  # the output projection, [vocab, hidden]
    scale: float  # logits are divided by it (Granite's logits_scaling)


def output_head(model: AdaptedLM | torch.nn.Module) -> OutputHead | None:
    """The decoder and the plain linear output projection of a causal LM (peft-wrapped or not); None when the
    logits are more than a linear projection (a bias, soft-capping, a multiplier), and the plain loss is used."""
    lm = base_of(model)
    head, config = lm.get_output_embeddings(), lm.config
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) is not None:
        return None
    return OutputHead(lm.get_decoder(), head.weight, float(getattr(config, "logits_scaling", 1.0) or 1.0))
