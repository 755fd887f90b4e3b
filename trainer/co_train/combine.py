"""Several jobs' micro-batches as one batch for one forward: their rows one job after another, each job's rows a
contiguous span, all in the packed form (position ids that restart at each sequence, no attention mask), right-
padded to the widest row with padding that is a sequence of its own and learns nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.co_train.layer import Routing
from trainer.data import IGNORE, Batch


@dataclass
class Combined:
    """The group's batch for one forward, and where each job's rows are in it."""

    batch: Batch
    spans: dict[str, slice]  # job -> its rows

    @property
    def routing(self) -> Routing:
        return Routing(list(self.spans.items()))


def positions_of(batch: Batch) -> torch.Tensor:
    """The batch's position ids: a packed batch's own; a padded one's 0..n-1 over each row's real tokens, its
    padding a sequence of its own (as trainer.data packs a short row's tail)."""
    if batch.position_ids is not None:
        return batch.position_ids
    mask = batch.attention_mask.bool()
    real = mask.long().cumsum(-1) - 1
    tail = (~mask).long().cumsum(-1) - 1
    return torch.where(mask, real, tail)


def widen(t: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), fill)], dim=1)


def widened_positions(positions: torch.Tensor, width: int) -> torch.Tensor:
    """Positions right-padded to `width`: the new columns a padding sequence of their own, starting at 0."""
    extra = width - positions.shape[1]
    if not extra:
        return positions
    return torch.cat([positions, torch.arange(extra).expand(positions.shape[0], extra)], dim=1)


def combine(micro: dict[str, Batch], pad_id: int) -> Combined:
    """Each job's micro-batch (in the order given) stacked into one packed batch."""
    width = max(b.input_ids.shape[1] for b in micro.values())
    ids, targets, positions, spans, at = [], [], [], {}, 0
    for job, b in micro.items():
        ids.append(widen(b.input_ids, width, pad_id))
        targets.append(widen(b.targets, width, IGNORE))
        positions.append(widened_positions(positions_of(b), width))
        spans[job] = slice(at, at + b.input_ids.shape[0])
        at += b.input_ids.shape[0]
    tokens = sum(b.tokens for b in micro.values())
    return Combined(Batch(torch.cat(ids), torch.cat(targets), torch.cat(positions), None, tokens), spans)
