"""Group relative policy optimisation (Shao et al., 2024), as TRL's GRPOTrainer computes its loss by default.

A step's completions were sampled by the adapter as it is (trainer/objectives/rollouts.py), so the sampling policy's
log-probabilities are the adapter's own, detached: the ratio is 1 on the one pass a batch gets (TRL's
num_iterations=1), and the clip never binds. Per completion token t, with A the completion's advantage and log p
at the sampling temperature (logits / temperature, as TRL scores them):

    ratio = exp(log p(t) - log p_old(t))
    KL(t) = exp(log p_ref(t) - log p(t)) - (log p_ref(t) - log p(t)) - 1
    loss(t) = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon) * A) + beta * KL(t) * ratio

KL times the ratio is TRL's use_bias_correction_kl (on by default): its value is KL's, its gradient the unbiased
reverse KL's (DeepSeek-V3.2). The step's loss is the sum over every completion token of the step divided by their
number (TRL's default loss_type "dapo"): each token weighs the same, however long its completion. The reference
(beta > 0) is DPO's: the base with the adapter switched off, or the adapter the job started from, frozen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from trainer.objectives.chunked_loss import chunked_token_logps
from trainer.objectives.dpo import reference
from trainer.objectives.losses import output_head
from trainer.objectives.rollouts import Rollout

if TYPE_CHECKING:
    from trainer.model import AdaptedLM


def token_logps(
    model: AdaptedLM, batch: Rollout, temperature: float, autocast_dtype, chunk_tokens: int
) -> torch.Tensor:
    """log p of each completion token at the sampling temperature: [rows, completion width] (positions counted
    from each row's first real token, as generate counts them)."""
    width = batch.completion_mask.shape[1]
    positions = (batch.attention_mask.cumsum(-1) - 1).masked_fill(batch.attention_mask == 0, 1)
    inputs = dict(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions, use_cache=False
    )
    targets = batch.input_ids[:, -width:]
    head = output_head(model) if chunk_tokens else None
    with torch.autocast(
        device_type=batch.input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32
    ):
        out = head.decoder(**inputs).last_hidden_state if head else model(**inputs).logits
    out = out[:, -width - 1 : -1]  # the positions that predict the completion's tokens
    if head:
        flat = chunked_token_logps(
            out.reshape(-1, out.shape[-1]), head.weight, targets.reshape(-1), chunk_tokens, head.scale * temperature
        )
        return flat.view(targets.shape)
    logps = F.log_softmax(out.float() / temperature, dim=-1)
    return logps.gather(-1, targets[..., None]).squeeze(-1)


def grpo_loss(
    model: AdaptedLM, batch: Rollout, beta: float, epsilon: float, temperature: float, autocast_dtype, chunk_tokens: int
) -> tuple[torch.Tensor, float]:
    """The batch's loss summed over its completion tokens (divide by the step's), and its KL summed over them."""
    logps = token_logps(model, batch, temperature, autocast_dtype, chunk_tokens)
    ratio = torch.exp(logps - logps.detach())  # the sampling policy is the adapter as it is: 1, with its gradient
    advantages = batch.advantages[:, None]
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * advantages)
    mask = batch.completion_mask
    kl_sum = 0.0
    if beta:
        with torch.no_grad(), reference(model):
            ref = token_logps(model, batch, temperature, autocast_dtype, chunk_tokens)
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token = per_token + beta * kl * ratio  # TRL's use_bias_correction_kl: 1, its gradient the unbiased KL's
        kl_sum = float((kl.detach() * mask).sum())
    return (per_token * mask).sum(), kl_sum
