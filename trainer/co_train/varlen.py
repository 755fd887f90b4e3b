"""Attention for the group's flat batch: every member's micro-batch laid end to end in one row of token positions
(trainer/co_train/combine.py), so that no member's rows are padded to another's width. Everything in a decoder but
attention works token by token; attention is computed here piece by piece, each member's rows as they were in its
own batch ([rows, heads, width, head_dim]), under the model's own kernel and the mask transformers makes for that
batch alone (sdpa: the packed rows' block-diagonal causal mask), so a member's attention is what it is when the
member trains alone. Under flash attention nothing is switched: the flat row is a packed batch of sequences, which
its varlen path takes as it is (transformers finds the sequences by their position ids).

The model's attention implementation is switched to this one only inside `flat_attention` (the group's forward);
evaluation, samples and the dpo reference's own forwards go through the model's kernel as usual."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "jetlora_co_train_flat"
KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3")  # what the trainer loads models with (model.py)


@dataclass
class Piece:
    """One member's rows in the flat row: where they start, their shape, and what its own batch's attention takes."""

    start: int
    rows: int
    width: int
    positions: torch.Tensor  # [rows, width]
    mask: torch.Tensor | None  # what transformers makes for this batch alone (None: plain causal, or varlen)


@dataclass
class Layout:
    kernel: str  # the model's own implementation, which each piece goes through
    pieces: list[Piece]


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
    """The layout of (start, positions [rows, width]) pieces, each with the mask its batch alone would have (none
    under flash attention, which attends the flat row as it is)."""
    config, out = model.config, []
    if config._attn_implementation.startswith("flash_attention"):
        return Layout(config._attn_implementation, [])
    for start, positions in pieces:
        rows, width = positions.shape
        shape = torch.empty((rows, width, 1), device=positions.device)  # only its shape, dtype and device count
        mask = create_causal_mask(
            config=config, inputs_embeds=shape, attention_mask=None, cache=None, position_ids=positions
        )  # fmt: skip
        out.append(Piece(start, rows, width, positions, mask))
    return Layout(config._attn_implementation, out)


@contextmanager
def flat_attention(model, flat: Layout):
    """Forwards of `model` in this block attend piece by piece as `flat` says (as they are, without pieces)."""
    if not flat.pieces:
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
    """The attention of the flat row [1, heads, tokens, head_dim]: each piece through the model's own kernel."""
    flat = _now.get()
    if flat is None:
        raise RuntimeError(f"attention {NAME} runs only inside trainer.co_train.varlen.flat_attention")
    kernel = ALL_ATTENTION_FUNCTIONS[flat.kernel]
    kwargs.pop("position_ids", None)
    outs = []
    for p in flat.pieces:
        q, k, v = (_piece(t, p) for t in (query, key, value))
        out, _ = kernel(module, q, k, v, p.mask, position_ids=p.positions, **kwargs)  # [rows, width, heads, dim]
        outs.append(out.reshape(1, p.rows * p.width, *out.shape[2:]))
    return torch.cat(outs, dim=1), None


def _piece(t: torch.Tensor, p: Piece) -> torch.Tensor:
    """[1, heads, tokens, dim] -> the piece's [rows, heads, width, dim] (views, no copy)."""
    tokens = t.transpose(1, 2)[0, p.start : p.start + p.rows * p.width]  # [rows * width, heads, dim]
    return tokens.reshape(p.rows, p.width, *tokens.shape[1:]).transpose(1, 2)


AttentionInterface.register(NAME, _attention)
