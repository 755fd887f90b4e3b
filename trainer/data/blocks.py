"""Blocks of dataset rows to token arrays, across the node's cores.

Each block is decoded, rendered and tokenized by itself, so blocks go to worker processes (forked from the
trainer: they share its tokenizer without loading it again) and come back in file order; only a few are in
flight at once, so memory stays bounded whatever the file's size. A chat dataset's first block is rendered both
the fast way (each assistant turn found in one render) and the exact way; where they differ the whole file is
done the exact way.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from trainer.data.formats import ROW_OF, Rendered, render, render_pair, token_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MIN_BLOCKS_FOR_WORKERS = 8  # below this, starting workers costs more than it saves
MAX_WORKERS = 16


@dataclass
class TokenBlock:
    ids: np.ndarray  # int64, the block's examples back to back
    learnt: np.ndarray  # uint8: 1 where the token after ids[t] is learnt
    ends: np.ndarray  # int64: where each example ends, counted from the block's start
    rows: int
    skipped: int  # rows with nothing to learn within max_seq_length


@dataclass
class Blocks:
    """How this dataset's rows become tokens: its format, tokenizer, max length and loss mask."""

    fmt: str
    tokenizer: PreTrainedTokenizerBase
    max_len: int
    completions_only: bool
    fast: bool = True

    def renders(self, row, fast: bool) -> list[Rendered]:
        """What one row becomes: one text, or a preference pair's two (chosen, then rejected)."""
        if self.fmt == "preference":
            return list(render_pair(self.tokenizer, row, fast))
        return [render(self.fmt, row, self.tokenizer, self.completions_only, fast)]

    def block(self, lines: list[bytes]) -> TokenBlock:
        decoder = msgspec.json.Decoder(ROW_OF[self.fmt])
        rendered = [r for line in lines for r in self.renders(decoder.decode(line), self.fast)]
        rows = token_rows(rendered, self.tokenizer, self.max_len)
        if self.fmt == "preference":  # a pair is kept whole or not at all: both answers must leave a token to learn
            kept = [(c[0], r[0]) for c, r in zip(rows[::2], rows[1::2]) if c and r]
            pieces, skipped = [example for pair in kept for example in pair], len(lines) - len(kept)
        else:
            pieces, skipped = [example for row in rows for example in row], sum(not row for row in rows)
        lengths = np.fromiter((len(ids) for ids, _ in pieces), np.int64, len(pieces))
        return TokenBlock(
            np.concatenate([ids for ids, _ in pieces]) if pieces else np.zeros(0, np.int64),
            np.concatenate([learnt for _, learnt in pieces]) if pieces else np.zeros(0, np.uint8),
            np.cumsum(lengths),
            len(lines),
            skipped,
        )

    def check_fast(self, lines: list[bytes]) -> None:
        """Keep the fast way only if it finds the same spans as the exact way on these rows."""
        if not (self.fmt == "preference" or (self.fmt == "chat" and self.completions_only)):
            return  # only assistant turns are found the fast way
        decoder = msgspec.json.Decoder(ROW_OF[self.fmt])
        rows = [decoder.decode(line) for line in lines]
        self.fast = all(self.renders(row, True) == self.renders(row, False) for row in rows)

    def tokenized(self, blocks: Iterable[list[bytes]], workers: int | None = None) -> Iterator[TokenBlock]:
        """Each block's tokens, in order; the first block decides fast or exact, the rest go to workers."""
        blocks = iter(blocks)
        first = next(blocks, None)
        if first is None:
            return
        self.check_fast(first)
        yield self.block(first)
        ahead = list(itertools.islice(blocks, MIN_BLOCKS_FOR_WORKERS))
        rest = itertools.chain(ahead, blocks)
        workers = usable_cores() if workers is None else workers
        if workers < 2 or len(ahead) < MIN_BLOCKS_FOR_WORKERS:
            yield from (self.block(b) for b in rest)
        else:
            yield from self._in_workers(rest, workers)

    def _in_workers(self, blocks: Iterator[list[bytes]], workers: int) -> Iterator[TokenBlock]:
        global _FORKED
        _FORKED = self
        pending: deque[Future] = deque()
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            for b in blocks:
                pending.append(pool.submit(_block_in_worker, b))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()


_FORKED: Blocks | None = None  # what a forked worker tokenizes with: set in the trainer before the fork


def _block_in_worker(lines: list[bytes]) -> TokenBlock:
    assert _FORKED is not None
    return _FORKED.block(lines)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container's cpuset sets it), at most MAX_WORKERS."""
    try:
        return min(len(os.sched_getaffinity(0)), MAX_WORKERS)
    except AttributeError:
        return min(os.cpu_count() or 1, MAX_WORKERS)
