"""A frozen base linear and every adapter's LoRA on its own rows as one autograd step (LoRAFusion's idea, in torch's
own ops): the forward adds each run's delta into the base output in place (addmm_/baddbmm_), and the backward
computes the input's gradient as one matmul through the base weight with each run's LoRA part added into it in
place, and each adapter's gradients from its own rows. Without it autograd keeps the base output and each delta
apart, adds them, splits and joins the rows and sums the input's two gradients: passes over tensors as big as the
batch that cost a CPU more than the LoRA's own matmuls do.

What it computes is the same as trainer/multi_lora/layer.py's other paths (each row's delta its own adapter's,
delta(x) = x @ A^T * scaling @ B^T), for the cases it takes: a plain float nn.Linear, no autocast, no dropout
(whose draws the other paths make as a job alone makes them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

Run = tuple[int, int, list]  # [start, stop) rows of the 2-D input, and the LoraWeights of its equal shares


def takes(base_layer, x: torch.Tensor, loras: list, training: bool) -> bool:
    """Whether the fused step computes this layer's output exactly as the other paths would (a frozen base: it
    gives the base weight and bias no gradient)."""
    weight, bias = getattr(base_layer, "weight", None), getattr(base_layer, "bias", None)
    return (
        type(base_layer) is torch.nn.Linear
        and weight is not None
        and not weight.requires_grad
        and not (bias is not None and bias.requires_grad)
        and weight.dtype == x.dtype
        and not torch.is_autocast_enabled(x.device.type)
        and all(lora.A.dtype == x.dtype and not (training and lora.dropout) for lora in loras)
    )


def base_and_loras(base_layer: torch.nn.Linear, x: torch.Tensor, runs: list[Run]) -> torch.Tensor:
    """The base layer's output for x ([rows, in]) with each run's adapters' deltas on their rows."""
    params = [p for _, _, loras in runs for lora in loras for p in (lora.A, lora.B)]
    shape = [(start, stop, len(loras), tuple(lora.scaling for lora in loras)) for start, stop, loras in runs]
    return BaseAndLoras.apply(x, base_layer.weight, base_layer.bias, shape, *params)


NARROW = 16  # below this rank, a CPU GEMM whose output is r columns wide ran 2-4x slower than its transpose's (MKL,
# 2 cores: g @ B for r = 8 and out = 768 took 250 us, (B^T @ g^T) 110 us), so the backward computes those two transposed


class BaseAndLoras(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, runs, *params):
        out = F.linear(x, weight, bias)
        lows, at = [], 0
        for start, stop, k, scalings in runs:
            A, B = _stacked(params[at : at + 2 * k])
            at += 2 * k
            xs = x[start:stop].reshape(k, -1, x.shape[-1])
            low = torch.bmm(xs, A.transpose(1, 2))  # [k, rows, r], its scaling not yet applied
            _add_scaled(out[start:stop].view(k, -1, out.shape[-1]), low, B.transpose(1, 2), _scale(scalings, low))
            lows.append(low)
        ctx.runs = runs
        ctx.save_for_backward(x, weight, *lows, *params)
        return out

    @staticmethod
    def backward(ctx, *grads):
        grad = grads[0]
        x, weight, *rest = ctx.saved_tensors
        lows, params = rest[: len(ctx.runs)], rest[len(ctx.runs) :]
        grad_x = grad.mm(weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        out_params, at = [], 0
        for (start, stop, k, scalings), low in zip(ctx.runs, lows):
            A, B = _stacked(params[at : at + 2 * k])
            at += 2 * k
            scale = _scale(scalings, low)
            g = grad[start:stop].reshape(k, -1, grad.shape[-1])  # [k, rows, out]
            if A.shape[1] < NARROW:  # the r-wide products computed as their transposes
                grad_B = torch.bmm(low.transpose(1, 2), g).transpose(1, 2)  # [k, out, r]
                grad_low = torch.bmm(B.transpose(1, 2), g.transpose(1, 2)).transpose(1, 2)  # [k, rows, r]
            else:
                grad_B = torch.bmm(g.transpose(1, 2), low)
                grad_low = torch.bmm(g, B)  # its scaling not yet applied
            grad_A = torch.bmm(grad_low.transpose(1, 2), x[start:stop].reshape(k, -1, x.shape[-1]))  # [k, r, in]
            if grad_x is not None:
                _add_scaled(grad_x[start:stop].view(k, -1, grad_x.shape[-1]), grad_low, A, scale)
            grad_A.mul_(scale)  # the scaling on the adapter-sized results, never on a pass over the rows
            grad_B.mul_(scale)
            for i in range(k):
                out_params += [grad_A[i], grad_B[i]]
        return grad_x, None, None, None, *out_params


def _add_scaled(out: torch.Tensor, low: torch.Tensor, B: torch.Tensor, scale: float | torch.Tensor) -> None:
    """out += scale * low @ B, in place ([k, rows, *]): the scaling in the matmul where the run has one."""
    if isinstance(scale, float):
        out.baddbmm_(low, B, alpha=scale)
    else:
        out.baddbmm_(low * scale, B)


def _stacked(params) -> tuple[torch.Tensor, torch.Tensor]:
    """[k, r, in] and [k, out, r] of a run's (A, B) pairs (views of the one adapter's, when it is alone)."""
    if len(params) == 2:
        return params[0][None], params[1][None]
    return torch.stack(params[0::2]), torch.stack(params[1::2])


def _scale(scalings: tuple[float, ...], like: torch.Tensor) -> float | torch.Tensor:
    if len(set(scalings)) == 1:
        return float(scalings[0])
    return torch.tensor(scalings, dtype=like.dtype, device=like.device).view(-1, 1, 1)
