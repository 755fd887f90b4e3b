"""Preparing a chat dataset for training: the streamed, memory-mapped token cache against tokenizing it all in
memory (what the trainer did with inline data), in the same run.

    .venv/bin/python bench/dataset_prep.py [--rows 40000] [--rounds 3]

Each side runs in its own process (so each peak RSS is its own), alternating A B A B; the medians and the
ratio ours/baseline are printed, with the spread over rounds. A third line shows a cached dataset's load.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_dataset(path: Path, rows: int) -> None:
    from tests.qa import QA_PAIRS

    with open(path, "w") as f:
        for n in range(rows):
            q, a = QA_PAIRS[n % len(QA_PAIRS)]
            f.write(json.dumps({"messages": [{"role": "system", "content": f"Conversation {n}: answer in full."},
                                             {"role": "user", "content": q}, {"role": "assistant", "content": a},
                                             {"role": "user", "content": "Say it again, please."},
                                             {"role": "assistant", "content": a}]}) + "\n")


def side(which: str, model: str, data: str, rows: int, cache: str) -> dict:
    """One measurement, in this (fresh) process."""
    import msgspec

    from schemas.datasets import ChatRow
    from schemas.events import DataFile
    from trainer.data import Examples
    from trainer.formats import examples_of, render
    from transformers import AutoTokenizer

    from trainer.tokenize import tokenized

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    t0 = time.perf_counter()
    if which == "baseline":
        decoder = msgspec.json.Decoder(ChatRow)
        all_rows = [decoder.decode(line) for line in open(data, "rb")]
        rendered = [render("chat", r, tok, True) for r in all_rows]
        examples = Examples.of([ex for row in examples_of(rendered, tok, 1024) for ex in row])
    else:
        f = DataFile(path=data, sha256="bench", format="chat", rows=rows)
        examples, _ = tokenized(f, tok, model, 1024, True, Path(cache), lambda *a: None)
    seconds = time.perf_counter() - t0
    tokens = int(examples.offsets[-1])
    return {"seconds": seconds, "tokens": tokens, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_side(which: str, model: Path, data: Path, rows: int, cache: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--side", which, "--model", str(model), "--data", str(data),
                          "--rows", str(rows), "--cache", str(cache)], capture_output=True, text=True, check=True)
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
    results = {"baseline": [], "ours": [], "cached": []}
    for r in range(args.rounds):
        for which in (("baseline", "ours") if r % 2 == 0 else ("ours", "baseline")):
            cache = tmp / f"cache-{r}"
            results[which].append(run_side(which, model, data, args.rows, cache))
        results["cached"].append(run_side("ours", model, data, args.rows, tmp / f"cache-{r}"))

    def median(which, key):
        return statistics.median(x[key] for x in results[which])

    base_s, base_mib = median("baseline", "seconds"), median("baseline", "peak_mib")
    for which in ("baseline", "ours", "cached"):
        s, mib = median(which, "seconds"), median(which, "peak_mib")
        ratios = [x["peak_mib"] / b["peak_mib"] for x, b in zip(results[which], results["baseline"])]
        rate = f"{results[which][0]['tokens'] / s:10,.0f} tok/s" if s > 0.05 else "(memory-mapped)"
        print(f"{which:9s} {s:7.2f} s  {rate:>16}  peak {mib:7.1f} MiB  "
              f"time x{s / base_s:.2f}  peak x{mib / base_mib:.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
