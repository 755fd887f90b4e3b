"""Real-token throughput of jetlora's trainer (padding-free packing) against transformers.Trainer + peft
with the default padding collator: same model, same 2,000 Q/A pairs of varied length, same steps and
hyperparameters, in one run, the sides alternating round by round; the median ratio and its spread are reported.
Then a job on 2 ranks (1 thread each, gloo) against 1 rank with 1 thread on the same examples per step, both
started as the agent starts them, alternating the same way. Run by hand:

    python bench/train_throughput.py [--rounds 4 --steps 20 --rank-rounds 4]
"""

from __future__ import annotations

import argparse
import io
import random
import resource
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import torch  # noqa: E402

from schemas.events import Progress, TrainerEvent, TrainerSpec  # noqa: E402
from schemas.jobs import JobRequest  # noqa: E402

WORDS = (
    "the model learns to answer questions about capitals rivers mountains languages and history of many "
    "countries with short and long explanations that vary in length from a few words to several sentences"
).split()


def make_pairs(n: int, seed: int = 0) -> list[dict]:
    """Q/A pairs whose answers range from a few words to a few hundred tokens, like real SFT data."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = " ".join(rng.choices(WORDS, k=rng.randint(4, 20))) + "?"
        a = " ".join(rng.choices(WORDS, k=int(rng.paretovariate(1.2) * 8) % 300 + 3)) + "."
        out.append({"q": f"Question {i}: {q}", "a": a})
    return out


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_jetlora(
    model_dir, pairs, steps, lr, tokens_per_step, seq, packing: bool = True, batch: int | None = None
) -> dict:
    """Packed: rows of at most seq tokens, as many as tokens_per_step fills; padded: `batch` examples a step."""
    from trainer.job.loop import train

    rows = batch if batch is not None else max(1, tokens_per_step // seq)
    req = msgspec.convert(
        {
            "model": "bench",
            "base_dir": str(model_dir),
            "data": pairs,
            "lora": {"r": 16, "alpha": 32},
            "train": {
                "max_steps": steps,
                "learning_rate": lr,
                "batch_size": rows,
                "packing": packing,
                "max_seq_length": seq,
                "logging_steps": min(10, steps),
                "warmup_steps": 0,
                "lr_scheduler": "cosine",
            },
        },
        JobRequest,
    )
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, write_through=True)  # the trainer writes events to sys.stdout.buffer
    with tempfile.TemporaryDirectory() as tmp, redirect_stdout(out):
        t0 = time.perf_counter()
        train(TrainerSpec(job="bench", attempt=1, request=req, out_dir=tmp))
        wall = time.perf_counter() - t0
    dec = msgspec.json.Decoder(TrainerEvent)
    progress = [
        e
        for e in (dec.decode(line) for line in raw.getvalue().decode().splitlines() if line.startswith("{"))
        if isinstance(e, Progress)
    ]
    last = progress[-1]
    return {"tokens_per_s": last.tokens / last.elapsed_s, "tokens": last.tokens, "loss": last.loss, "wall": wall}


def run_ranks(model_dir, pairs, steps, lr, examples_per_step, seq, ranks: int) -> dict:
    """The trainer as the agent runs it: `ranks` processes of one thread each, each with its share of the step."""
    import asyncio

    from services.agent.runner import DEFAULT_TRAINER, TrainerRun

    req = msgspec.convert(
        {
            "model": "bench",
            "base_dir": str(model_dir),
            "data": pairs,
            "lora": {"r": 16, "alpha": 32},
            "devices": ranks,
            "train": {
                "max_steps": steps,
                "learning_rate": lr,
                "packing": False,
                "batch_size": examples_per_step // ranks,
                "max_seq_length": seq,
                "logging_steps": 1,
                "warmup_steps": 0,
            },
        },
        JobRequest,
    )
    progress = []

    async def on_event(ev) -> None:
        if isinstance(ev, Progress):
            progress.append(ev)

    with tempfile.TemporaryDirectory() as tmp:
        spec = TrainerSpec(job="bench", attempt=1, request=req, out_dir=f"{tmp}/out", device="cpu")
        result = asyncio.run(
            TrainerRun(spec, Path(tmp), DEFAULT_TRAINER, {"OMP_NUM_THREADS": "1"}, ranks).run(on_event)
        )
    if not progress:
        raise RuntimeError(f"the {ranks}-rank run failed: {getattr(result, 'message', result)}")
    first, last = progress[0], progress[-1]  # from the first step's end: process start and loading left out
    return {"tokens_per_s": (last.tokens - first.tokens) / (last.elapsed_s - first.elapsed_s), "loss": last.loss}


def run_baseline(model_dir, pairs, steps, lr, batch, seq, cpu: bool = True, flatten: bool = False) -> dict:
    """transformers.Trainer + peft, padding each batch (DataCollatorForSeq2Seq) or, with `flatten`, concatenating it
    into one row told apart by position ids (DataCollatorWithFlattening, transformers' padding-free way)."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        DataCollatorWithFlattening,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, use_safetensors=True, dtype=torch.float32
    )
    model = get_peft_model(
        model,
        LoraConfig(
            r=16,
            lora_alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        ),
    )

    from trainer.data.examples import prompt_text

    rows = []
    for p in pairs:  # the same tokens and the same completion-only labels as jetlora's
        prompt = tok(prompt_text(tok, p["q"]), add_special_tokens=False)["input_ids"]
        answer = tok(p["a"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = (prompt + answer)[:seq]
        rows.append(
            {"input_ids": ids, "labels": ([-100] * len(prompt) + answer)[:seq]}
            | ({} if flatten else {"attention_mask": [1] * len(ids)})
        )
    real = {"tokens": 0}
    base_collate = DataCollatorWithFlattening() if flatten else DataCollatorForSeq2Seq(tok, padding=True)

    def collate(features):
        batch = base_collate(features)
        real["tokens"] += sum(len(f["input_ids"]) for f in features)
        return batch

    losses = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=batch,
            max_steps=steps,
            learning_rate=lr,
            lr_scheduler_type="cosine",
            logging_steps=min(10, steps),
            report_to=[],
            use_cpu=cpu,
            bf16=not cpu,
            save_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
            seed=42,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[Losses()])
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    return {"tokens_per_s": real["tokens"] / wall, "tokens": real["tokens"], "loss": losses[-1], "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20, help="steps per side per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds against transformers.Trainer (0: skip)")
    ap.add_argument("--batch", type=int, default=8, help="examples per step for the baseline")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rank-rounds", type=int, default=4, help="rounds of 2 ranks against 1 (0: skip)")
    ap.add_argument(
        "--rows",
        default="",
        metavar="1024,2048,4096",
        help="packed rows of these lengths against padded batches of as many tokens (empty: skip)",
    )
    ap.add_argument("--row-rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "demo"))
    from tinymodel import build

    pairs = make_pairs(2000)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(
            Path(tmp) / "m",
            [f"{p['q']} {p['a']}" for p in pairs[:500]],
            hidden=384,
            layers=12,
            heads=6,
            kv_heads=2,
            intermediate=1024,
            vocab_size=8000,
            init_range=0.02,
        )
        n_params = sum(
            t.numel()
            for t in __import__("safetensors.torch", fromlist=["x"])
            .load_file(str(model_dir / "model.safetensors"))
            .values()
        )
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        lengths = [len(tok(p["q"] + " " + p["a"])["input_ids"]) + 8 for p in pairs]
        mean = sum(lengths) / len(lengths)
        tokens_per_step = int(
            args.batch * mean
        )  # jetlora's step holds as many real tokens as the baseline's, on average
        print(
            f"model {n_params / 1e6:.1f}M params; 2000 pairs, {min(lengths)}-{max(lengths)} tokens (mean {mean:.0f}); "
            f"{args.rounds} rounds of {args.steps} steps, lr {args.lr}, {torch.get_num_threads()} threads"
        )
        rounds = []
        for r in range(args.rounds):  # alternate the sides (A B, B A, ...), so background load favours neither
            sides = [
                ("base", lambda: run_baseline(model_dir, pairs, args.steps, args.lr, args.batch, args.seq)),
                ("jet", lambda: run_jetlora(model_dir, pairs, args.steps, args.lr, tokens_per_step, args.seq)),
            ]
            result = {name: run() for name, run in (sides if r % 2 == 0 else sides[::-1])}
            rounds.append(result)
            print(
                f"  round {r + 1}: baseline {result['base']['tokens_per_s']:6.0f} tok/s, jetlora "
                f"{result['jet']['tokens_per_s']:6.0f} tok/s: {result['jet']['tokens_per_s'] / result['base']['tokens_per_s']:.2f}x",
                flush=True,
            )
        if rounds:
            ratios = sorted(r["jet"]["tokens_per_s"] / r["base"]["tokens_per_s"] for r in rounds)
            losses = [r["jet"]["loss"] / r["base"]["loss"] for r in rounds]
            print(
                f"throughput ratio jetlora/baseline: median {statistics.median(ratios):.2f}x (rounds "
                f"{ratios[0]:.2f}-{ratios[-1]:.2f}); final loss ratio {statistics.median(losses):.3f}; peak RSS "
                f"{peak_rss_mib():.0f} MiB"
            )
        if args.rank_rounds:
            compare_ranks(model_dir, pairs, args)
        for seq in [int(x) for x in args.rows.split(",") if x]:
            compare_packing(model_dir, pairs, args, seq, mean)


def compare_packing(model_dir, pairs, args, seq: int, mean: float) -> None:
    """Two packed rows of `seq` tokens a step against padded batches holding as many tokens on average, and against
    transformers.Trainer with DataCollatorWithFlattening on those batches: real tokens per second, the sides
    rotating round by round."""
    batch = max(1, round(2 * seq / mean))
    rounds = []
    for r in range(args.row_rounds):
        sides = [
            ("packed", lambda: run_jetlora(model_dir, pairs, args.steps, args.lr, 2 * seq, seq)),
            ("padded", lambda: run_jetlora(model_dir, pairs, args.steps, args.lr, 0, seq, False, batch)),
            ("flattening", lambda: run_baseline(model_dir, pairs, args.steps, args.lr, batch, seq, flatten=True)),
        ]
        order = sides[r % 3 :] + sides[: r % 3]
        rounds.append({name: run() for name, run in order})
        print(
            f"  rows of {seq}: "
            + ", ".join(
                f"{n} {rounds[-1][n]['tokens_per_s']:6.0f} tok/s (loss {rounds[-1][n]['loss']:.3f})" for n, _ in sides
            )
            + f"; {batch} examples a batch",
            flush=True,
        )
    for other in ("padded", "flattening"):
        ratios = sorted(x["packed"]["tokens_per_s"] / x[other]["tokens_per_s"] for x in rounds)
        print(
            f"rows of {seq}: packed / {other} median {statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}-"
            f"{ratios[-1]:.2f})"
        )


def compare_ranks(model_dir, pairs, args) -> None:
    print(f"2 ranks x 1 thread against 1 rank x 1 thread, {args.batch} examples a step, {args.rank_rounds} rounds:")
    rounds = []
    for r in range(args.rank_rounds):
        sides = [
            (n, lambda n=n: run_ranks(model_dir, pairs, args.steps, args.lr, args.batch, args.seq, n)) for n in (1, 2)
        ]
        result = {n: run() for n, run in (sides if r % 2 == 0 else sides[::-1])}
        rounds.append(result)
        print(
            f"  round {r + 1}: 1 rank {result[1]['tokens_per_s']:6.0f} tok/s, 2 ranks {result[2]['tokens_per_s']:6.0f} "
            f"tok/s: {result[2]['tokens_per_s'] / result[1]['tokens_per_s']:.2f}x "
            f"(final loss {result[1]['loss']:.4f} / {result[2]['loss']:.4f})",
            flush=True,
        )
    ratios = sorted(r[2]["tokens_per_s"] / r[1]["tokens_per_s"] for r in rounds)
    print(f"2 ranks / 1 rank: median {statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
