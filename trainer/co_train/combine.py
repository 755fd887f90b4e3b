"""Several jobs' micro-batches as one batch for one forward, in the packed form (position ids that restart at each
sequence, no attention mask), each job's part contiguous. Two layouts:

flat    every job's rows end to end in one row of token positions: nothing is padded to another job's width, so
        the step holds what each job's own batch holds (the sum the scheduler's group estimate adds up); attention
        is computed per job's rows by trainer/multi_lora/varlen.py. The layout wherever the model allows it.
padded  the jobs' rows stacked, right-padded to the widest row with padding that is a sequence of its own and
        learns nothing: for models whose attention the flat layout does not compute (sliding windows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.multi_lora import varlen
from trainer.multi_lora.layer import Routing
from trainer.data.examples import IGNORE, Batch


@dataclass
class Combined:
    """The group's batch for one forward, and where each job's part is in it."""

    batch: Batch
    spans: dict[str, slice]  # job -> its rows (padded) or its token positions (flat)
    shapes: dict[str, tuple[int, int]]  # job -> (rows, width) of its own micro-batch
    layout: varlen.Layout | None = None  # flat: how attention goes piece by piece

    @property
    def routing(self) -> Routing:
        return Routing(list(self.spans.items()), tokens=self.layout is not None)

    def positions(self, job: str) -> int:
        """Token positions the job takes in the batch (its rows, padded ones to the batch's width)."""
        rows, width = self.shapes[job]
        return rows * (width if self.layout is not None else self.batch.input_ids.shape[1])

    def out_of(self, out: torch.Tensor, job: str) -> torch.Tensor:
        """The job's part of the model's output, shaped as its own batch's ([rows, width, ...]; padded: the batch's
        width)."""
        if self.layout is None:
            return out[self.spans[job]]
        rows, width = self.shapes[job]
        return out[0, self.spans[job]].reshape(rows, width, *out.shape[2:])

    def targets_of(self, job: str) -> torch.Tensor:
        return self.out_of(self.batch.targets.unsqueeze(-1), job).squeeze(-1)


def positions_of(batch: Batch) -> torch.Tensor:
    """The batch's position ids: a packed batch's own; a padded one's 0..n-1 over each row's real tokens, its
    padding a sequence of its own (as trainer.data.examples packs a short row's tail)."""
    if batch.position_ids is not None:
        return batch.position_ids
    assert batch.attention_mask is not None, "a padded batch (no position ids) has its attention mask"
    mask = batch.attention_mask.bool()
    real = mask.long().cumsum(-1) - 1
    tail = (~mask).long().cumsum(-1) - 1
    return torch.where(mask, real, tail)


def alike_together(micro: dict[str, Batch], ranks: dict[str, int]) -> dict[str, Batch]:
    """The micro-batches in the order that lays alike jobs side by side: by width, then rows, then LoRA rank (ties
    as given). Adjacent jobs of one width attend in one kernel call (varlen.py); of one shape and rank, their LoRAs
    go through one batched matmul (layer.py). No job's result depends on where its rows are."""
    order = sorted(micro, key=lambda job: (micro[job].input_ids.shape[1], micro[job].input_ids.shape[0], ranks[job]))
    return {job: micro[job] for job in order}


def combine(micro: dict[str, Batch], pad_id: int, model=None) -> Combined:
    """Each job's micro-batch (in the order given) as one batch: flat when `model`'s attention allows it."""
    if model is not None and varlen.supported(model):
        return combine_flat(micro, model)
    return combine_padded(micro, pad_id)


def combine_flat(micro: dict[str, Batch], model) -> Combined:
    ids, targets, positions, spans, shapes, pieces, at = [], [], [], {}, {}, [], 0
    for job, b in micro.items():
        rows, width = b.input_ids.shape
        ids.append(b.input_ids.reshape(-1))
        targets.append(b.targets.reshape(-1))
        own = positions_of(b)
        positions.append(own.reshape(-1))
        spans[job], shapes[job] = slice(at, at + rows * width), (rows, width)
        pieces.append((at, own))
        at += rows * width
    tokens = sum(b.tokens for b in micro.values())
    batch = Batch(torch.cat(ids)[None], torch.cat(targets)[None], torch.cat(positions)[None], None, tokens)
    return Combined(batch, spans, shapes, varlen.layout(model, pieces))


def widen(t: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), fill)], dim=1)


def widened_positions(positions: torch.Tensor, width: int) -> torch.Tensor:
    """Positions right-padded to `width`: the new columns a padding sequence of their own, starting at 0."""
    extra = width - positions.shape[1]
    if not extra:
        return positions
    pad = torch.arange(extra, device=positions.device).expand(positions.shape[0], extra)
    return torch.cat([positions, pad], dim=1)


def combine_padded(micro: dict[str, Batch], pad_id: int) -> Combined:
    width = max(b.input_ids.shape[1] for b in micro.values())
    ids, targets, positions, spans, shapes, at = [], [], [], {}, {}, 0
    for job, b in micro.items():
        ids.append(widen(b.input_ids, width, pad_id))
        targets.append(widen(b.targets, width, IGNORE))
        positions.append(widened_positions(positions_of(b), width))
        spans[job], shapes[job] = slice(at, at + b.input_ids.shape[0]), (b.input_ids.shape[0], b.input_ids.shape[1])
        at += b.input_ids.shape[0]
    tokens = sum(b.tokens for b in micro.values())
    return Combined(Batch(torch.cat(ids), torch.cat(targets), torch.cat(positions), None, tokens), spans, shapes)
