"""Examples as flat token arrays (in memory, or memory-mapped from the token cache), and batches drawn from them
on demand: packed into rows of at most max_seq_length, or padded."""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import torch

from trainer.errors import JobError
from trainer.data.formats import IGNORE, Example, examples_of, prompt_text, prompt_tokens, render  # noqa: F401
from trainer.objectives.rft import Prompts, prompt_batches

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["IGNORE", "Example", "Examples", "Batch", "encode", "split", "split_pairs", "make_batches", "prompt_text"]


@dataclass
class Examples:
    """Examples back to back: ids[offsets[i]:offsets[i + 1]] is example i (through `rows`, a subset of them)."""

    ids: np.ndarray  # int32, or uint16 where the vocabulary fits (the token cache stores them so)
    targets: "np.ndarray | ShiftedTargets"  # int32, IGNORE where nothing is predicted
    offsets: np.ndarray  # int64, one more than the examples
    rows: np.ndarray | None = None  # which examples this set holds; None: all

    @classmethod
    def of(cls, examples: list[Example]) -> "Examples":
        lengths = [len(ex.ids) for ex in examples]
        return cls(
            np.fromiter((t for ex in examples for t in ex.ids), np.int32, sum(lengths)),
            np.fromiter((t for ex in examples for t in ex.targets), np.int32, sum(lengths)),
            np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]),
        )

    def _row(self, i: int) -> int:
        return int(self.rows[i]) if self.rows is not None else i

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        rows = self.rows if self.rows is not None else np.arange(len(self.offsets) - 1)
        return self.offsets[rows + 1] - self.offsets[rows]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        r = self._row(i)
        a, b = self.offsets[r], self.offsets[r + 1]
        return self.ids[a:b].astype(np.int32, copy=False), self.targets[a:b]

    def subset(self, positions: np.ndarray) -> "Examples":
        rows = self.rows[positions] if self.rows is not None else positions
        return Examples(self.ids, self.targets, self.offsets, rows)


def encode(
    tokenizer: PreTrainedTokenizerBase, pairs, max_seq_length: int, completions_only: bool = True
) -> list[Example]:
    """Inline Q/A pairs (a job's `data`) to examples; a question too long for max_seq_length is an error."""
    if tokenizer.eos_token_id is None:
        raise JobError("the tokenizer has no eos token; add one to tokenizer_config.json so answers can end")
    rendered = [render("qa", pair, tokenizer, completions_only) for pair in pairs]
    out = []
    for n, (r, row) in enumerate(zip(rendered, examples_of(rendered, tokenizer, max_seq_length))):
        if not row:
            raise JobError(
                f"data[{n}]: the question takes {prompt_tokens(tokenizer, r)} tokens with its template, "
                f"max_seq_length is {max_seq_length}; raise train.max_seq_length or shorten the question"
            )
        out += row
    return out


def split(examples: Examples, eval_fraction: float, seed: int) -> tuple[Examples, Examples]:
    order = np.random.default_rng(seed).permutation(len(examples))
    n_eval = max(1, int(len(examples) * eval_fraction)) if eval_fraction else 0
    return examples.subset(np.sort(order[n_eval:])), examples.subset(np.sort(order[:n_eval]))


def split_pairs(examples: Examples, eval_fraction: float, seed: int) -> tuple[Examples, Examples]:
    """split() for preference data, where examples 2i and 2i + 1 are pair i's chosen and rejected answers: whole
    pairs are held out, and each side keeps its pairs' two examples next to each other."""
    pairs = len(examples) // 2
    order = np.random.default_rng(seed).permutation(pairs)
    n_eval = max(1, int(pairs * eval_fraction)) if eval_fraction else 0

    def rows(chosen: np.ndarray) -> np.ndarray:
        return np.stack([2 * chosen, 2 * chosen + 1], axis=1).reshape(-1)

    return examples.subset(rows(np.sort(order[n_eval:]))), examples.subset(rows(np.sort(order[:n_eval])))


class ShiftedTargets:
    """Targets kept as a mask: at a learnt position the target is the next token (ids[t + 1]), elsewhere IGNORE.
    What the token cache stores (a byte a token instead of four); sliced like the array it stands for."""

    def __init__(self, ids: np.ndarray, learnt: np.ndarray) -> None:
        self.ids, self.learnt = ids, learnt

    def __len__(self) -> int:
        return len(self.learnt)

    def __getitem__(self, span: slice) -> np.ndarray:
        a, b, _ = span.indices(len(self.learnt))
        following = np.full(b - a, IGNORE, np.int32)
        following[: max(0, min(b, len(self.ids) - 1) - a)] = self.ids[a + 1 : b + 1]
        return np.where(self.learnt[a:b].astype(bool), following, np.int32(IGNORE))


@dataclass
class Batch:
    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    tokens: int  # real tokens in the batch (no padding)

    def to(self, device) -> "Batch":
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return Batch(
            self.input_ids.to(device),
            self.targets.to(device),
            move(self.position_ids),
            move(self.attention_mask),
            self.tokens,
        )


class Batches(Sequence[Batch | None]):
    """An epoch's batches as lists of example positions; each Batch's tensors are made when it is taken."""

    def __init__(self, examples: Examples, groups: list, packed: bool, pad_id: int) -> None:
        """groups: each batch's example positions; packed, a list of rows of them."""
        self.examples, self.groups, self.packed, self.pad_id = examples, groups, packed, pad_id

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not len(self.groups[i]):
            return None  # a rank's share of a batch too small to go round
        if self.packed:
            return _pack([[self.examples[int(p)] for p in row] for row in self.groups[i]], self.pad_id)
        return _pad([self.examples[int(p)] for p in self.groups[i]], self.pad_id)

    def shard(self, rank: int, ranks: int) -> "Batches":
        """This rank's contiguous share of every batch: the ranks' shares together are the whole batch."""
        if ranks == 1:
            return self
        share = [g[len(g) * rank // ranks : len(g) * (rank + 1) // ranks] for g in self.groups]
        return Batches(self.examples, share, self.packed, self.pad_id)


def _shuffled(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def packed_rows(lengths: np.ndarray, row_tokens: int, seed: int) -> list[list[int]]:
    """Examples into rows of at most row_tokens, best-fit decreasing: each example, longest first (equal lengths in
    a seeded order), goes into the row it leaves least room in; a row is opened when none has room."""
    order = sorted(_shuffled(len(lengths), seed), key=lambda i: -int(lengths[i]))
    free: list[tuple[int, int]] = []  # (room left, row), ascending
    rows: list[list[int]] = []
    for i in order:
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))  # the least room that still holds it
        if k < len(free):
            room, r = free.pop(k)
        else:
            room, r = row_tokens, len(rows)
            rows.append([])
        rows[r].append(i)
        if room > n:
            bisect.insort(free, (room - n, r))
    return rows


def packed_batches(examples: Examples | list[Example], row_tokens: int, rows_per_batch: int, seed: int) -> Batches:
    """Whole examples packed into rows of at most row_tokens (max_seq_length), rows_per_batch rows to a batch,
    positions restarting at each example.

    transformers sees position ids that restart and no attention mask, and builds a block-diagonal causal mask
    per row (or takes the varlen path on flash attention): no example attends to another, attention costs the
    square of a row, not of the batch, and only a row's tail is padding.
    """
    examples = examples if isinstance(examples, Examples) else Examples.of(examples)
    rows = packed_rows(examples.lengths(), row_tokens, seed)
    order = _shuffled(len(rows), seed)  # long and short rows mixed through the epoch
    groups = [[np.array(rows[r]) for r in order[s : s + rows_per_batch]] for s in range(0, len(order), rows_per_batch)]
    return Batches(examples, groups, packed=True, pad_id=0)


def padded_batches(examples: Examples | list[Example], batch_size: int, seed: int, pad_id: int) -> Batches:
    """The usual way: batch_size examples per batch, right-padded to the longest."""
    examples = examples if isinstance(examples, Examples) else Examples.of(examples)
    order = np.array(_shuffled(len(examples), seed), dtype=np.int64)
    return Batches(examples, [order[s : s + batch_size] for s in range(0, len(order), batch_size)], False, pad_id)


def pair_batches(examples: Examples, pairs_per_batch: int, seed: int, pad_id: int) -> Batches:
    """Preference pairs (examples 2i, 2i + 1), pairs_per_batch to a batch: its chosen answers, then its rejected
    ones in the same order, right-padded (what dpo.dpo_loss reads)."""
    order = np.array(_shuffled(len(examples) // 2, seed), dtype=np.int64)
    groups = [
        np.concatenate([2 * order[s : s + pairs_per_batch], 2 * order[s : s + pairs_per_batch] + 1])
        for s in range(0, len(order), pairs_per_batch)
    ]
    return Batches(examples, groups, False, pad_id)


def _pack(rows: list[list[tuple[np.ndarray, np.ndarray]]], pad_id: int) -> Batch:
    """Rows of examples back to back; a row shorter than the longest ends in padding that is a sequence of its
    own (positions restart there too), whose targets are IGNORE."""
    width = max(sum(len(ex[0]) for ex in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    real = 0
    for n, row in enumerate(rows):
        at = 0
        for row_ids, row_targets in row:
            k = len(row_ids)
            ids[n, at : at + k] = torch.from_numpy(row_ids.astype(np.int64))
            targets[n, at : at + k] = torch.from_numpy(np.asarray(row_targets, dtype=np.int64))
            positions[n, at : at + k] = torch.arange(k)
            at += k
        positions[n, at:] = torch.arange(width - at)
        real += at
    return Batch(ids, targets, positions, None, real)


def _pad(rows: list[tuple[np.ndarray, np.ndarray]], pad_id: int) -> Batch:
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    targets = torch.full((len(rows), width), IGNORE)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for n, (row_ids, row_targets) in enumerate(rows):
        ids[n, : len(row_ids)] = torch.from_numpy(row_ids.astype(np.int64))
        targets[n, : len(row_ids)] = torch.from_numpy(row_targets.astype(np.int64))
        mask[n, : len(row_ids)] = 1
    return Batch(ids, targets, None, mask, sum(len(r[0]) for r in rows))


EpochBatches: TypeAlias = Batches | list[Prompts]  # an epoch's batches: sft's and dpo's tokens, or grpo's prompts


def make_batches(examples, train_cfg, pad_id: int, epoch: int, rank: int = 0, ranks: int = 1) -> EpochBatches:
    """An epoch's batches; with several ranks each takes its share of batches `ranks` times batch_size, so a
    step sees the same examples as one process with that batch would."""
    seed = train_cfg.seed + epoch
    size = train_cfg.batch_size * ranks
    if train_cfg.method == "dpo":  # one device (the request's checks): a rank's share would split pairs
        return pair_batches(examples, train_cfg.batch_size, seed, pad_id)
    if train_cfg.method == "grpo":  # prompts (rft.Prompts), answered as each step comes; one device, as dpo
        return prompt_batches(examples, train_cfg.batch_size, seed)
    if train_cfg.packing:
        return packed_batches(examples, train_cfg.max_seq_length, size, seed).shard(rank, ranks)
    return padded_batches(examples, size, seed, pad_id).shard(rank, ranks)
