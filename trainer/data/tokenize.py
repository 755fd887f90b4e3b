"""A dataset file to token arrays on disk, in bounded memory, kept for the next job on the same data.

The file is read a block of rows at a time; ids, targets and offsets are appended to files that are
memory-mapped for training. The result is kept per dataset sha256, tokenizer, chat template, format, max
length and loss mask, so a rerun, a resumed job or another job with the same settings skips this step.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from schemas.dataset_check import UTF8_BOM
from schemas.events import DataFile, Preparing
from trainer.data.blocks import Blocks
from trainer.data.examples import Examples, ShiftedTargets, encode, split, split_pairs
from trainer.errors import JobError
from trainer.events import emit

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from schemas.events import TrainerSpec

CACHE_VERSION = 2  # raise when what is written changes (2: ids in the narrowest type, targets as a mask)
BLOCK_ROWS = 512
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def cache_key(
    data: DataFile, tokenizer: PreTrainedTokenizerBase, base_dir: str, max_len: int, completions_only: bool
) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = Path(base_dir) / name
        h.update(name.encode() + (p.read_bytes() if p.is_file() else b"-"))
    h.update(
        json.dumps([CACHE_VERSION, data.format, max_len, completions_only, tokenizer.chat_template or ""]).encode()
    )
    return f"{data.sha256}-{h.hexdigest()[:16]}"


def load(directory: Path) -> Examples:
    meta = json.loads((directory / "meta.json").read_text())

    def mapped(name, dtype):
        path = directory / name
        return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)

    ids = mapped("ids.bin", np.dtype(meta["ids_dtype"]))
    return Examples(ids, ShiftedTargets(ids, mapped("learnt.bin", np.uint8)), mapped("offsets.bin", np.int64))


def ids_dtype(tokenizer: PreTrainedTokenizerBase) -> np.dtype:
    """The narrowest integer type every token id of the tokenizer fits in."""
    return np.dtype(np.uint16) if len(tokenizer) <= 2**16 else np.dtype(np.int32)


def tokenized(
    data: DataFile,
    tokenizer: PreTrainedTokenizerBase,
    base_dir: str,
    max_len: int,
    completions_only: bool,
    cache: Path,
    report: Callable[[int, int, str], None],
) -> tuple[Examples, dict]:
    """The dataset's examples, from the cache or tokenized into it; report(done, total, message) along the way."""
    final = cache / cache_key(data, tokenizer, base_dir, max_len, completions_only)
    if not (final / "meta.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=cache, prefix=".tokenizing-"))
        try:
            meta = _tokenize(data, tokenizer, max_len, completions_only, work, report)
            (work / "meta.json").write_text(json.dumps(meta))
            try:
                os.rename(work, final)  # another job may have made it meanwhile: theirs is as good
            except OSError:
                pass
        finally:
            shutil.rmtree(work, ignore_errors=True)
    meta = json.loads((final / "meta.json").read_text())
    if not meta["examples"]:
        raise JobError(
            f"no row of the dataset leaves a token to learn within train.max_seq_length {max_len} "
            f"({meta['skipped']:,} rows skipped); raise max_seq_length"
        )
    return load(final), meta


def _tokenize(
    data: DataFile,
    tokenizer: PreTrainedTokenizerBase,
    max_len: int,
    completions_only: bool,
    out: Path,
    report: Callable[[int, int, str], None],
) -> dict:
    if tokenizer.eos_token is None:
        raise JobError("the tokenizer has no eos token; add one to tokenizer_config.json so answers can end")
    rows = skipped = examples = tokens = 0
    last_report = 0.0
    id_type = ids_dtype(tokenizer)
    blocks = Blocks(data.format, tokenizer, max_len, completions_only)
    with (
        open(data.path, "rb") as src,
        open(out / "ids.bin", "wb") as ids_f,
        open(out / "learnt.bin", "wb") as tgt_f,
        open(out / "offsets.bin", "wb") as off_f,
    ):
        off_f.write(array("q", [0]).tobytes())
        for block in blocks.tokenized(_row_blocks(src)):
            ids_f.write(block.ids.astype(id_type).tobytes())
            tgt_f.write(block.learnt.tobytes())
            off_f.write((block.ends + tokens).tobytes())
            rows, skipped, examples = rows + block.rows, skipped + block.skipped, examples + len(block.ends)
            tokens += len(block.ids)
            if time.monotonic() - last_report > 1.0:
                last_report = time.monotonic()
                report(rows, data.rows, f"tokenizing {rows / max(data.rows, 1):.0%} of {_count(data.rows)} rows")
    report(
        rows,
        data.rows,
        f"tokenized {_count(rows)} rows: {examples:,} examples, {tokens:,} tokens"
        + (f", {skipped:,} rows skipped (nothing to learn within max_seq_length)" if skipped else ""),
    )
    return {"rows": rows, "examples": examples, "tokens": tokens, "skipped": skipped, "ids_dtype": id_type.name}


def _row_blocks(src) -> Iterator[list[bytes]]:
    """The file's non-blank lines, BLOCK_ROWS at a time (a leading BOM dropped, as the check at upload does)."""
    block: list[bytes] = []
    for n, line in enumerate(src):
        if not n:
            line = line.removeprefix(UTF8_BOM)
        if line.strip():
            block.append(line)
            if len(block) == BLOCK_ROWS:
                yield block
                block = []
    if block:
        yield block


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n:,}"


def job_data(spec: TrainerSpec, tokenizer: PreTrainedTokenizerBase) -> tuple[Examples, Examples]:
    """A job's training and held-out examples: its inline data, or its datasets, tokenized or from the cache."""
    t = spec.request.train

    def report(done: int, total: int, message: str) -> None:
        emit(Preparing(done=done, total=total, message=message))

    def of(data: DataFile) -> Examples:
        cache = Path(spec.token_cache) if spec.token_cache else Path(spec.out_dir) / "tokens"
        return tokenized(data, tokenizer, spec.request.base_dir, t.max_seq_length, t.completions_only, cache, report)[0]

    if spec.request.dataset is not None and spec.dataset is None:
        raise JobError(
            f"the job names dataset {spec.request.dataset.name}, but the agent did not fetch it; run the "
            "trainer through a jetlora agent"
        )
    if spec.dataset is not None:
        examples = of(spec.dataset)
    elif not spec.request.data:
        raise JobError("the job has no training data: name a dataset or send Q/A pairs in data")
    else:
        examples = Examples.of(encode(tokenizer, spec.request.data, t.max_seq_length, t.completions_only))
    if spec.validation is not None:
        return examples, of(spec.validation)
    return (split_pairs if t.method == "dpo" else split)(examples, t.eval_fraction, t.seed)
