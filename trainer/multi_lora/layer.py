"""One frozen nn.Linear of the shared base with every job's LoRA on it: the base output once for the whole batch,
then one matmul pair per adapter group of rows, added to those rows only."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trainer.multi_lora import fused


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
        return F.linear(self.low(x, training), self.B) * self.scaling

    def low(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        """dropout(x) @ A^T: the rank-r part of the delta."""
        x = x.to(self.A.dtype)
        if self.dropout and training:
            keep = torch.empty_like(x).bernoulli_(1 - self.dropout, generator=self.generator)
            x = x * keep / (1 - self.dropout)
        return F.linear(x, self.A)


class MultiLoraLinear(torch.nn.Module):
    """Wraps a frozen base linear layer once; holds the LoRA of each job that targets it, by job name. Reads the
    current batch's Routing from the object shared by every wrapped layer of the model."""

    def __init__(self, base_layer: torch.nn.Linear, routing: "RoutingHolder") -> None:
        super().__init__()
        self.base_layer = base_layer
        self.routing = routing
        self.adapters: dict[str, LoraWeights] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.routing.now
        mine = [(self.adapters[name], rows) for name, rows in routing.groups if name in self.adapters]
        if mine and all(isinstance(rows, slice) for _, rows in mine):
            if fused.takes(self.base_layer, x, [lora for lora, _ in mine], self.training):
                return self._fused(x, mine, routing.tokens)
        out = self.base_layer(x)
        if routing.tokens:  # [batch, tokens, features] taken as [positions, features] (views)
            flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
            return self._add_deltas(routing, flat_x, flat_out).reshape(out.shape)
        return self._add_deltas(routing, x, out)

    def _fused(self, x: torch.Tensor, mine: list, tokens: bool) -> torch.Tensor:
        """The base and the adapters in one autograd step (trainer/multi_lora/fused.py), x taken as [positions, in]."""
        flat = x.reshape(-1, x.shape[-1])
        per_row = 1 if tokens else flat.shape[0] // max(x.shape[0], 1)  # rows: each a row's positions
        spans = []
        for lora, rows in mine:
            start, stop, _ = rows.indices(flat.shape[0] if tokens else x.shape[0])
            spans.append((lora, slice(start * per_row, stop * per_row)))
        runs = [run for run in _runs(spans, flat.shape[0]) if run[2]]
        return fused.base_and_loras(self.base_layer, flat, runs).reshape(*x.shape[:-1], -1)

    def _add_deltas(self, routing: Routing, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        mine = [(self.adapters[name], rows) for name, rows in routing.groups if name in self.adapters]
        if not mine:  # no job of the batch targets this layer
            return out
        spans = [(lora, rows) for lora, rows in mine if isinstance(rows, slice)]
        if len(spans) == len(mine):
            return with_spans(spans, x, out, self.training)
        deltas = [(rows, lora.delta(x[rows], self.training).to(out.dtype)) for lora, rows in mine]
        return out + indexed_delta(deltas, out)


def with_spans(spans: list[tuple[LoraWeights, slice]], x: torch.Tensor, out: torch.Tensor, training: bool):
    """`out` with each adapter's delta added to its span of rows (x's and out's first dimension). x and out are
    split once into runs, never sliced per adapter (each slice's backward would fill a tensor as big as x): a run is
    a gap of no adapter, one adapter's span, or adjacent spans of one size whose adapters have one shape and no
    dropout, which go through batched matmuls together (trainer/co_train/combine.py lays the group's jobs out so
    that such spans are adjacent). Each run's delta is added in its last matmul (addmm, baddbmm), and the runs are
    joined once."""
    runs = _runs(spans, x.shape[0])
    if len(runs) == 1:
        return _run_out(x, out, runs[0][2], training)
    sizes = [stop - start for start, stop, _ in runs]
    xs, outs = torch.split(x, sizes), torch.split(out, sizes)
    return torch.cat([_run_out(xr, o, loras, training) for xr, o, (_, _, loras) in zip(xs, outs, runs)])


def _runs(spans: list[tuple[LoraWeights, slice]], n: int) -> list[tuple[int, int, list[LoraWeights]]]:
    """The [start, stop) runs covering n rows, each with its adapters (none: a gap)."""
    runs: list[tuple[int, int, list[LoraWeights]]] = []
    at = 0
    for lora, rows in sorted(spans, key=lambda s: s[1].indices(n)[0]):
        start, stop, _ = rows.indices(n)
        if start > at:
            runs.append((at, start, []))
        if runs and runs[-1][2] and _joins(runs[-1], lora, start, stop):
            runs[-1] = (runs[-1][0], stop, [*runs[-1][2], lora])
        else:
            runs.append((start, stop, [lora]))
        at = stop
    if at < n:
        runs.append((at, n, []))
    return runs


def _joins(run: tuple[int, int, list[LoraWeights]], lora: LoraWeights, start: int, stop: int) -> bool:
    """Whether the span [start, stop) of `lora` goes through the batched matmuls with the run before it."""
    first, loras = run[2][0], run[2]
    return (
        run[1] == start
        and stop - start == (run[1] - run[0]) // len(loras)
        and lora.A.shape == first.A.shape
        and lora.B.shape == first.B.shape
        and not lora.dropout
        and not first.dropout
    )


def _run_out(x: torch.Tensor, out: torch.Tensor, loras: list[LoraWeights], training: bool) -> torch.Tensor:
    """A run's rows of out with their deltas added: each adapter's on its equal share of the run's rows."""
    if not loras:
        return out
    if len(loras) == 1:
        lora = loras[0]
        low = lora.low(x, training) * lora.scaling
        return _plus(out.reshape(1, -1, out.shape[-1]), low.reshape(1, -1, low.shape[-1]), lora.B[None]).view(out.shape)
    k = len(loras)
    A = torch.stack([lora.A for lora in loras])  # [k, r, in]
    B = torch.stack([lora.B for lora in loras])  # [k, out, r]
    low = torch.bmm(x.to(A.dtype).reshape(k, -1, x.shape[-1]), A.transpose(1, 2))  # [k, rows, r]
    scalings = [lora.scaling for lora in loras]
    if len(set(scalings)) == 1:
        low = low * scalings[0]
    else:
        low = low * torch.tensor(scalings, dtype=low.dtype, device=low.device).view(k, 1, 1)
    return _plus(out.reshape(k, -1, out.shape[-1]), low, B).view(out.shape)


def _plus(out: torch.Tensor, low: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """out + low @ B^T ([k, rows, *]), in one baddbmm where the dtypes allow (else the delta cast to out's)."""
    if out.dtype == low.dtype or torch.is_autocast_enabled(out.device.type):
        return torch.baddbmm(out, low, B.transpose(1, 2))
    return out + torch.bmm(low, B.transpose(1, 2)).to(out.dtype)


def indexed_delta(deltas: list[tuple[slice | torch.Tensor, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
    """The groups' deltas as one tensor shaped like `out` (zero for rows of no group), each added at its rows."""
    full = out.new_zeros(out.shape)
    for rows, delta in deltas:
        index = rows.to(out.device) if isinstance(rows, torch.Tensor) else torch.arange(out.shape[0])[rows]
        full = full.index_add(0, index.to(out.device), delta)
    return full


class RoutingHolder:
    """The routing of the batch going through the model now, shared by every MultiLoraLinear of one base."""

    def __init__(self) -> None:
        self.now = Routing()
