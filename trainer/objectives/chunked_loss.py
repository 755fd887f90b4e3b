"""Cross-entropy through the output projection, a chunk of tokens at a time: peak memory no longer grows with
tokens x vocabulary.

The plain loss materialises every token's logits ([tokens x vocab], then again in fp32): for a 128k vocabulary and
4,096 tokens that is 2 GB before the backward. Here the forward keeps only the summed loss, and the backward
recomputes each chunk's logits to turn them into gradients, as Liger-Kernel's fused linear cross-entropy and
Unsloth do, so at most one chunk's logits exist at a time. grpo's per-token log-probabilities go through the
projection the same way (chunked_token_logps: each chunk checkpointed, its logits made again in the backward).
"""

from __future__ import annotations

import torch

from trainer.data.examples import IGNORE

DEFAULT_CHUNK_TOKENS = 1024


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens t with targets[t] != IGNORE of -log softmax(hidden[t] @ weight.T / scale)[targets[t]]."""

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, scale: float
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = _logits(hidden[start : start + chunk], weight, scale)
            total += torch.nn.functional.cross_entropy(
                logits, targets[start : start + chunk], ignore_index=IGNORE, reduction="sum"
            )
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk, ctx.scale = chunk, scale
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[start : start + ctx.chunk], targets[start : start + ctx.chunk]
            # d loss / d logits = softmax - one_hot(target), zero for ignored tokens
            grad_logits = torch.softmax(_logits(h, weight, ctx.scale), dim=-1)
            kept = t != IGNORE
            rows = torch.nonzero(kept).squeeze(1)
            grad_logits[rows, t[rows]] -= 1.0
            grad_logits[~kept] = 0.0
            grad_logits *= grad_total / ctx.scale
            if grad_hidden is not None:
                # in the weight's dtype: an fp32 copy of a bf16 [vocab x hidden] projection would cost 2 GB at 8B
                grad_hidden[start : start + ctx.chunk] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h.float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    logits = (hidden @ weight.T).float()
    return logits / scale if scale != 1.0 else logits


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = DEFAULT_CHUNK_TOKENS,
    scale: float = 1.0,
) -> torch.Tensor:
    """Summed cross-entropy of `hidden` [tokens, H] projected by `weight` [V, H] (and divided by `scale`, as
    Granite divides its logits) against `targets` [tokens]; IGNORE targets count for nothing."""
    return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk, scale)


def _token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    logits = _logits(hidden, weight, scale)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)


def chunked_token_logps(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, scale: float = 1.0
) -> torch.Tensor:
    """Each token's log softmax(hidden[t] @ weight.T / scale)[targets[t]]: [tokens]. A chunk's logits are made again
    in the backward (activation checkpointing), so at most one chunk's exist at a time."""
    from torch.utils.checkpoint import checkpoint

    return torch.cat(
        [
            checkpoint(_token_logps, hidden[s : s + chunk], weight, targets[s : s + chunk], scale, use_reentrant=False)
            for s in range(0, hidden.shape[0], chunk)
        ]
    )
