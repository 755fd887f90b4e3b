"""Peak memory and speed of one training step on a model with a 128k vocabulary: transformers.Trainer + peft (the
baseline), jetlora's plain loss (every token's logits at once) and its chunked loss, at the same batch. Each
measurement runs in its own process, so its peak RSS is its own; the sides alternate in rounds (A B C, C B A, ...)
and the medians are reported. Run by hand:

    python bench/train_memory.py [--rounds 3 --tokens 4096 --vocab 128256]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_step(chunk_tokens: int, tokens: int, vocab: int, hidden: int) -> dict:
    """In a fresh process: build a small-hidden, large-vocab Llama with LoRA, run forward and backward once."""
    sys.path.insert(0, str(ROOT))
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.data import examples as data
    from trainer.objectives.losses import batch_loss

    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=tokens,
    )
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, vocab, (1, tokens))
    batch = data.Batch(
        input_ids=ids,
        position_ids=torch.arange(tokens)[None],
        attention_mask=None,
        targets=torch.roll(ids, -1, 1),
        tokens=tokens,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    loss, n = batch_loss(model, batch, torch.float32, chunk_tokens)
    (loss / n).backward()
    took = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"loss": float(loss) / n, "step_mib": peak - before, "tokens_per_s": tokens / took}


def trainer_step(tokens: int, vocab: int, hidden: int) -> dict:
    """In a fresh process: the same model and LoRA, one step of transformers.Trainer on the same tokens."""
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=tokens,
    )
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, vocab, (tokens,))
    rows = [{"input_ids": ids, "labels": ids.clone()}]
    timing, losses = {}, []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            timing["before"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            timing["t0"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            timing["took"] = time.perf_counter() - timing["t0"]

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=1,
            max_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=1,
            learning_rate=1e-4,
        )
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()]).train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"loss": losses[-1], "step_mib": peak - timing["before"], "tokens_per_s": tokens / timing["took"]}


def measure(chunk_tokens: int, args) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one",
            str(chunk_tokens),
            "--tokens",
            str(args.tokens),
            "--vocab",
            str(args.vocab),
            "--hidden",
            str(args.hidden),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        step = trainer_step if args.one < 0 else one_step
        print(
            json.dumps(
                step(args.tokens, args.vocab, args.hidden)
                if args.one < 0
                else one_step(args.one, args.tokens, args.vocab, args.hidden)
            )
        )
        return
    sides = {
        "transformers.Trainer + peft": -1,
        "plain loss (all logits)": 0,
        f"chunked loss ({args.chunk} tokens)": args.chunk,
    }
    runs = {name: [] for name in sides}
    for r in range(args.rounds):  # alternate, so background load favours neither side
        for name, chunk in sides.items() if r % 2 == 0 else reversed(sides.items()):
            runs[name].append(measure(chunk, args))
    print(f"one step, {args.tokens} tokens, vocabulary {args.vocab:,}, hidden {args.hidden}, {args.rounds} rounds:")
    med = {}
    for name, results in runs.items():
        med[name] = {k: statistics.median(r[k] for r in results) for k in ("step_mib", "tokens_per_s", "loss")}
        spread = [round(r["step_mib"]) for r in results]
        print(
            f"  {name:34s} step peak {med[name]['step_mib']:8,.0f} MiB (runs {spread})  "
            f"{med[name]['tokens_per_s']:8,.0f} tok/s  loss {med[name]['loss']:.5f}"
        )
    baseline, plain, chunked = (med[name] for name in sides)
    for name, other in (("Trainer + peft", baseline), ("plain", plain)):
        print(
            f"chunked / {name}: peak {chunked['step_mib'] / other['step_mib']:.2f}x, "
            f"tokens/s {chunked['tokens_per_s'] / other['tokens_per_s']:.2f}x, "
            f"loss difference {abs(chunked['loss'] - other['loss']):.1e}"
        )


if __name__ == "__main__":
    main()
