"""Preparing a chat dataset for training: jetlora's token cache against what a user would run instead, Hugging
Face `datasets` (`Dataset.from_json(...).map(apply_chat_template + tokenize, batched=True)`, with the same
tokenizer), in the same run.

    .venv/bin/pip install -e ".[bench]"   # the baseline, Hugging Face datasets; jetlora does not need it
    .venv/bin/python bench/dataset_prep.py [--rows 40000] [--rounds 3]

Sides, each in its own fresh process (so each peak RSS is its own), alternating in each round: `hf` (one process,
as its docs show it), `hf-procs` (map with num_proc = the cores), `ours` (the trainer's preparing step: the learnt
mask too, which HF's side does not compute), `ours-1` (the same in one process), then `cached` (ours again on the
cache it made). Medians, the ratio of each time to `hf`'s, and the spread of that ratio over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


EXTRAS = ["", " 東京は日本の首都です。", " 🚀✨", " مرحبا بالعالم", " (see §2)"]


def make_dataset(path: Path, rows: int) -> None:
    """Chat rows as real sets have them: a system prompt on most, 1-4 turns, CJK, emoji and RTL text, a turn
    with weight 0, the optional name field."""
    from tests.qa import QA_PAIRS

    with open(path, "w") as f:
        for n in range(rows):
            messages = [{"role": "system", "content": f"Conversation {n}: answer in full."}] if n % 4 else []
            for turn in range(1 + n % 4):
                q, a = QA_PAIRS[(n + turn) % len(QA_PAIRS)]
                extra = EXTRAS[(n + turn) % len(EXTRAS)]
                messages.append(
                    {"role": "user", "content": q + extra, "name": "ana"}
                    if n % 7 == 0
                    else {"role": "user", "content": q + extra}
                )
                messages.append({"role": "assistant", "content": a + extra, "weight": 0 if turn == 1 else 1})
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")


def side(which: str, model: str, data: str, rows: int, cache: str) -> dict:
    """One measurement, in this (fresh) process."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    t0 = time.perf_counter()
    if which.startswith("hf"):
        from datasets import Dataset

        def tokenize(batch):
            texts = [tok.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
            return tok(texts, add_special_tokens=False)

        ds = Dataset.from_json(data, cache_dir=cache)
        procs = os.cpu_count() if which == "hf-procs" else None
        out = ds.map(tokenize, batched=True, remove_columns=ds.column_names, num_proc=procs)
        tokens = sum(len(ids) for ids in out["input_ids"])
    else:
        import trainer.data.blocks
        from schemas.events import DataFile
        from trainer.data.tokenize import tokenized

        if which == "ours-1":
            trainer.data.blocks.usable_cores = lambda: 1
        f = DataFile(path=data, sha256="bench", format="chat", rows=rows)
        examples, _ = tokenized(f, tok, model, 4096, True, Path(cache), lambda *a: None)
        tokens = int(examples.offsets[-1])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_side(which: str, model: Path, data: Path, rows: int, cache: Path) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--side",
            which,
            "--model",
            str(model),
            "--data",
            str(data),
            "--rows",
            str(rows),
            "--cache",
            str(cache),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--side")
    ap.add_argument("--model")
    ap.add_argument("--data")
    ap.add_argument("--cache")
    args = ap.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.model, args.data, args.rows, args.cache)))
        return

    from tests.conftest import tinymodel
    from tests.qa import QA_PAIRS

    tmp = Path(tempfile.mkdtemp(prefix="jetlora-bench-datasets-"))
    model = tinymodel().build(tmp / "model", [f"{q} {a}" for q, a in QA_PAIRS], vocab_size=400)
    data = tmp / "chat.jsonl"
    make_dataset(data, args.rows)
    print(f"{args.rows:,} chat rows, {data.stat().st_size / 2**20:.1f} MiB; {args.rounds} rounds, sides alternating")
    sides = ["hf", "hf-procs", "ours", "ours-1"]
    results: dict[str, list[dict]] = {which: [] for which in sides + ["cached"]}
    for r in range(args.rounds):
        for which in sides[r % len(sides) :] + sides[: r % len(sides)]:
            cache = tmp / f"cache-{r}-{which}"
            results[which].append(run_side(which, model, data, args.rows, cache))
        results["cached"].append(run_side("ours", model, data, args.rows, tmp / f"cache-{r}-ours"))

    def median(which, key):
        return statistics.median(x[key] for x in results[which])

    base = median("hf", "seconds")
    for which in sides + ["cached"]:
        s, mib = median(which, "seconds"), median(which, "peak_mib")
        speed = [b["seconds"] / x["seconds"] for x, b in zip(results[which], results["hf"])]
        print(
            f"{which:9s} {s:7.2f} s  {args.rows / s:9,.0f} rows/s  {results[which][0]['tokens']:>11,} tokens  "
            f"peak {mib:7.1f} MiB  speed x{base / s:.2f} of hf (rounds {min(speed):.2f}-{max(speed):.2f})"
        )
    ours = statistics.median(
        results["ours"][r]["seconds"] / results["cached"][r]["seconds"] for r in range(args.rounds)
    )
    print(f"cached rerun: x{ours:.0f} faster than the first")


if __name__ == "__main__":
    main()
