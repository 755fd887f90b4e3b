"""Attention for the group's flat batch: every member's micro-batch laid end to end in one row of token positions
(trainer/co_train/combine.py), so that no member's rows are padded to another's width. Everything in a decoder but
attention works token by token; attention here is computed sequence by sequence, as flash attention's varlen path
does: the sequences of every member (where position ids restart, and at each of a member's rows) are gathered into
buckets of about one length, each sequence right-padded to its bucket's width, and each bucket goes through the
model's own kernel once, causal and with no mask (sdpa's flash kernel then skips what a causal row never attends).
A token attends to exactly what it attends in its member's own batch (its own sequence, up to itself: transformers'
mask for packed rows), so a member's attention is what it is alone, to float rounding; the padding slots come after
every real token of their sequence, so no real token attends to them, and no gradient flows from them. What the
members' rows held in masks and in attention over other sequences' tokens is never computed. Under flash attention
nothing is switched: the flat row is a packed batch of sequences, which its varlen path takes as it is
(transformers finds the sequences by their position ids).

The model's attention implementation is switched to this one only inside `flat_attention` (the group's forward);
evaluation, samples and the dpo reference's own forwards go through the model's kernel as usual."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "jetlora_co_train_flat"
KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3")  # what the trainer loads models with (model.py)
STEP = 16  # a bucket's width is a sequence's length rounded up to this (to a quarter of its power of two past 128)


@dataclass
class Layout:
    """How the flat row's tokens go through the kernel: `gather` names, slot by slot of the buckets laid end to end,
    the flat token each slot takes (a padding slot any token: it is never attended); `scatter`, token by token, its
    slot; `buckets` (sequences, width) in the order their slots are laid. No buckets: the kernel takes the row."""

    kernel: str  # the model's own implementation, which each bucket goes through
    buckets: list[tuple[int, int]] = field(default_factory=list)
    gather: torch.Tensor | None = None  # [slots]
    scatter: torch.Tensor | None = None  # [tokens]
    padding: torch.Tensor | None = None  # the padding slots


_now: ContextVar[Layout | None] = ContextVar("co_train_flat_layout", default=None)


def supported(model) -> bool:
    """Whether the model's attention is one this layout computes exactly: every layer full causal attention (no
    sliding window, no layer types of other kinds) under one of KERNELS. Others take the padded layout."""
    config = model.config
    if config._attn_implementation not in KERNELS or not getattr(config, "is_causal", True):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return set(types) <= {"full_attention"}
    return not getattr(config, "sliding_window", None)


def layout(model, pieces: list[tuple[int, torch.Tensor]]) -> Layout:
    """The layout of (start, positions [rows, width]) pieces laid end to end in the flat row: its sequences in
    buckets (none under flash attention, which attends the flat row as it is)."""
    kernel = model.config._attn_implementation
    if kernel.startswith("flash_attention"):
        return Layout(kernel)
    positions = torch.cat([p.reshape(-1) for _, p in pieces])
    first = torch.ones_like(positions, dtype=torch.bool)
    first[1:] = positions[1:] != positions[:-1] + 1  # where a sequence starts, as transformers' packed mask says
    for start, p in pieces:  # and at every row of every piece
        first[start : start + p.numel() : p.shape[1]] = True
    starts = first.nonzero().squeeze(1)
    lengths = torch.diff(starts, append=starts.new_tensor([positions.numel()]))
    return _bucketed(kernel, starts, lengths, positions.numel())


def bucket_width(lengths: torch.Tensor) -> torch.Tensor:
    """Each length rounded up to its bucket's width: a multiple of STEP up to 128, past it of a quarter of the
    length's power of two (padding at most a quarter of a sequence past 128)."""
    big = lengths > 128
    step = torch.where(big, 2 ** (torch.log2(lengths.clamp(min=1).double()).floor().long() - 2), STEP)
    return (lengths + step - 1) // step * step


def _bucketed(kernel: str, starts: torch.Tensor, lengths: torch.Tensor, tokens: int) -> Layout:
    widths = bucket_width(lengths)
    order = torch.argsort(widths, stable=True)
    first_slot = torch.empty_like(starts)
    first_slot[order] = torch.cumsum(widths[order], 0) - widths[order]  # each sequence's first slot
    slots = int(widths.sum())
    owner = torch.searchsorted(first_slot[order], torch.arange(slots, device=starts.device), right=True) - 1
    owner = order[owner]  # the sequence each slot is of
    offset = torch.arange(slots, device=starts.device) - first_slot[owner]
    real = offset < lengths[owner]
    gather = torch.where(real, starts[owner] + offset, starts[owner])  # padding: its sequence's first token's copy
    sequence = torch.repeat_interleave(torch.arange(len(starts), device=starts.device), lengths)  # each token's
    scatter = first_slot[sequence] + torch.arange(tokens, device=starts.device) - starts[sequence]
    width, count = torch.unique_consecutive(widths[order], return_counts=True)
    return Layout(kernel, list(zip(count.tolist(), width.tolist())), gather, scatter, (~real).nonzero().squeeze(1))


@contextmanager
def flat_attention(model, flat: Layout):
    """Forwards of `model` in this block attend bucket by bucket as `flat` says (as they are, without buckets)."""
    if not flat.buckets:
        yield
        return
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    before = {key: c._attn_implementation for key, c in configs.items()}
    token = _now.set(flat)
    try:
        for c in configs.values():
            c._attn_implementation = NAME
        yield
    finally:
        for key, c in configs.items():
            c._attn_implementation = before[key]
        _now.reset(token)


def _attention(module, query, key, value, attention_mask, **kwargs):
    """The attention of the flat row [1, heads, tokens, head_dim]: each bucket through the model's own kernel."""
    flat = _now.get()
    if flat is None or flat.gather is None or flat.scatter is None or flat.padding is None:
        raise RuntimeError(f"attention {NAME} runs only inside trainer.multi_lora.varlen.flat_attention")
    kernel = ALL_ATTENTION_FUNCTIONS[flat.kernel]
    kwargs.pop("position_ids", None)
    into_slots = (flat.gather, flat.scatter, None, 1)  # along the tokens, in each tensor's own layout
    slotted = [Moved.apply(t.squeeze(0), *into_slots) for t in (query, key, value)]  # [heads, slots, dim]
    sizes = [n * width for n, width in flat.buckets]
    parts = zip(*(torch.split(t, sizes, dim=1) for t in slotted))  # one split: its backward joins them once
    outs = []
    for (n, width), bucket in zip(flat.buckets, parts):
        q, k, v = (t.unflatten(1, (n, width)).transpose(0, 1) for t in bucket)  # [n, heads, width, dim]
        out, _ = kernel(module, q, k, v, None, **kwargs)  # [n, width, heads, dim]
        outs.append(out.reshape(n * width, *out.shape[2:]))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return Moved.apply(out, flat.scatter, flat.gather, flat.padding, 0)[None], None


class Moved(torch.autograd.Function):
    """x's rows (along `dim`) taken in `index`'s order, whose gradient goes back by `back` (each row of x from the
    one row of the result it went to), `zero` rows of it zero (slots no token went to). Between the flat row's tokens and the
    buckets' slots every token has one slot and each padding slot a copy of its sequence's first token, whose
    gradient is exactly zero (it comes after every real token of its sequence: nothing attends to it, and what it
    attends is never used): so the gradient goes back as one gather, not a scatter-add into zeros."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, back: torch.Tensor, zero: torch.Tensor | None, dim: int):
        ctx.save_for_backward(back, zero)
        ctx.dim = dim
        if dim == 1 and x.stride(0) < x.stride(1):  # token-major memory ([tokens, heads, dim] seen as [heads, ...])
            return x.transpose(0, 1).index_select(0, index).transpose(0, 1)
        return x.index_select(dim, index)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        back, zero = ctx.saved_tensors
        grad = grads[0].index_select(ctx.dim, back)
        if zero is not None and zero.numel():
            grad.index_fill_(ctx.dim, zero, 0)
        return grad, None, None, None, None


AttentionInterface.register(NAME, _attention)
