"""One frozen nn.Linear of the shared base with every job's LoRA on it: the base output once for the whole batch,
then one matmul pair per adapter group of rows, added to those rows only."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class Routing:
    """Which rows of the batch now going through the model belong to which adapter: a list of (adapter, rows),
    rows a slice where they are contiguous (the group orders its batch so), else an index tensor. Rows named by no
    group get no delta anywhere: the base model alone (dpo's reference). With `tokens`, what the groups name are
    token positions of the batch taken as one row (the group's flat layout), not rows."""

    groups: list[tuple[str, slice | torch.Tensor]] = field(default_factory=list)
    tokens: bool = False

    @classmethod
    def of_rows(cls, adapters: list[str | None]) -> "Routing":
        """From each row's adapter (None: no adapter), grouping equal names."""
        rows: dict[str, list[int]] = {}
        for i, name in enumerate(adapters):
            if name is not None:
                rows.setdefault(name, []).append(i)
        return cls([(name, _as_rows(index)) for name, index in rows.items()])


def _as_rows(index: list[int]) -> slice | torch.Tensor:
    if index == list(range(index[0], index[0] + len(index))):
        return slice(index[0], index[0] + len(index))
    return torch.tensor(index, dtype=torch.long)


@dataclass
class LoraWeights:
    """One job's LoRA on one linear layer: delta(x) = dropout(x) @ A^T @ B^T * scaling."""

    A: torch.nn.Parameter  # [r, in]
    B: torch.nn.Parameter  # [out, r]
    scaling: float
    dropout: float = 0.0
    generator: torch.Generator | None = None  # the job's own dropout draws: its neighbours never change them

    def delta(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        x = x.to(self.A.dtype)
        if self.dropout and training:
            keep = torch.empty_like(x).bernoulli_(1 - self.dropout, generator=self.generator)
            x = x * keep / (1 - self.dropout)
        return F.linear(F.linear(x, self.A), self.B) * self.scaling


class MultiLoraLinear(torch.nn.Module):
    """Wraps a frozen base linear layer once; holds the LoRA of each job that targets it, by job name. Reads the
    current batch's Routing from the object shared by every wrapped layer of the model."""

    def __init__(self, base_layer: torch.nn.Linear, routing: "RoutingHolder") -> None:
        super().__init__()
        self.base_layer = base_layer
        self.routing = routing
        self.adapters: dict[str, LoraWeights] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        routing = self.routing.now
        if routing.tokens:  # [batch, tokens, features] taken as [positions, features] (views)
            flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
            return self._add_deltas(routing, flat_x, flat_out).reshape(out.shape)
        return self._add_deltas(routing, x, out)

    def _add_deltas(self, routing: Routing, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        deltas = []
        for name, rows in routing.groups:
            lora = self.adapters.get(name)
            if lora is not None:  # else this job does not target this layer
                deltas.append((rows, lora.delta(x[rows], self.training).to(out.dtype)))
        return out + spread(deltas, out) if deltas else out


def spread(deltas: list[tuple[slice | torch.Tensor, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
    """The groups' deltas as one tensor shaped like `out` (zero for rows of no group), to add in one go: spans
    are concatenated in order (no copy of the whole output per group, forward or backward); index groups are
    added at their rows."""
    spans = [(rows, delta) for rows, delta in deltas if isinstance(rows, slice)]
    if len(spans) == len(deltas):
        pieces, at, n = [], 0, out.shape[0]
        for span, delta in sorted(spans, key=lambda d: d[0].indices(n)[0]):
            start, stop, _ = span.indices(n)
            if start > at:
                pieces.append(out.new_zeros((start - at, *out.shape[1:])))
            pieces.append(delta)
            at = stop
        if at < n:
            pieces.append(out.new_zeros((n - at, *out.shape[1:])))
        return torch.cat(pieces)
    full = out.new_zeros(out.shape)
    for rows, delta in deltas:
        index = rows.to(out.device) if isinstance(rows, torch.Tensor) else torch.arange(out.shape[0])[rows]
        full = full.index_add(0, index.to(out.device), delta)
    return full


class RoutingHolder:
    """The routing of the batch going through the model now, shared by every MultiLoraLinear of one base."""

    def __init__(self) -> None:
        self.now = Routing()
