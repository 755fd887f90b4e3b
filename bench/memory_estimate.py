"""How close schemas/memory.py's estimate comes to real peaks: for several model and job shapes, two real training
steps (LoRA, AdamW, the trainer's own loss) in a fresh process each, peak memory against the estimate. On CPU the
peak is the process's RSS growth from just before the model is built; with --cuda, torch.cuda.max_memory_allocated
plus the CUDA context the estimate counts. Run by hand:

    python bench/memory_estimate.py [--cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.guarantees import Guarantees  # noqa: E402

# hidden, layers, intermediate, heads, kv_heads, vocab, tokens, gradient checkpointing, loss chunk, LoRA targets
SHAPES = [
    (256, 4, 688, 4, 4, 32000, 1024, False, 1024, "qv"),
    (256, 4, 688, 4, 4, 32000, 1024, True, 1024, "qv"),
    (512, 4, 1376, 8, 2, 32000, 2048, False, 1024, "all"),
    (512, 4, 1376, 8, 2, 32000, 2048, True, 1024, "all"),
    (128, 2, 344, 4, 4, 128256, 2048, False, 1024, "qv"),
    (128, 2, 344, 4, 4, 128256, 2048, False, 0, "qv"),
    (768, 6, 2048, 12, 4, 50000, 1024, False, 1024, "all"),
]
TARGETS = {
    "qv": ["q_proj", "v_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def config_of(shape) -> dict:
    h, layers, i, heads, kv, vocab, tokens, *_ = shape
    return {
        "hidden_size": h,
        "num_hidden_layers": layers,
        "intermediate_size": i,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": tokens,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def request_of(shape):
    import msgspec

    from schemas.jobs import JobRequest

    *_, tokens, checkpointing, chunk, targets = shape
    return msgspec.convert(
        {
            "model": "m",
            "base_dir": "/m",
            "data": [{"q": "q", "a": "a"}],
            "lora": {"r": 16, "target_modules": TARGETS[targets]},
            "train": {
                "batch_size": 1,
                "max_seq_length": tokens,
                "gradient_checkpointing": checkpointing,
                "loss_chunk_tokens": chunk,
                "precision": "fp32",
            },
        },
        JobRequest,
    )


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def two_steps(shape, cuda: bool) -> float:
    """In this fresh process: the model, LoRA, two optimizer steps; the peak MiB they took."""
    import resource

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.data import examples as data
    from trainer.objectives.losses import batch_loss

    torch.manual_seed(0)
    *_, tokens, checkpointing, chunk, targets = shape
    device = "cuda" if cuda else "cpu"
    config = LlamaConfig(**config_of(shape))
    before = rss_mib()
    model = LlamaForCausalLM(config).to(device, torch.bfloat16 if cuda else torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS[targets]))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    batch = data.Batch(
        input_ids=ids,
        position_ids=torch.arange(tokens, device=device)[None],
        attention_mask=None,
        targets=torch.roll(ids, -1, 1),
        tokens=tokens,
    )
    for _ in range(2):
        loss, n = batch_loss(model, batch, torch.bfloat16 if cuda else torch.float32, chunk)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument(
        "--under", type=float, default=0.10, help="how far under a real peak an estimate may be (0.10: 10%%)"
    )
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(two_steps(SHAPES[args.one], args.cuda)))
        return
    from schemas.memory import ModelShape, estimate

    device = "cuda" if args.cuda else "cpu"
    print(
        f"{'hidden':>6} {'layers':>6} {'vocab':>7} {'tokens':>6} {'ckpt':>5} {'chunk':>5} {'lora':>4} "
        f"{'measured':>9} {'estimate':>9} {'error':>7}"
    )
    errors = []
    for n, shape in enumerate(SHAPES):
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(n)] + (["--cuda"] if args.cuda else []),
            capture_output=True,
            text=True,
            check=True,
        )
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        model = ModelShape.from_config("/m", {**config_of(shape), **({"torch_dtype": "bfloat16"} if args.cuda else {})})
        req = request_of(shape)
        if args.cuda:
            import msgspec

            req = msgspec.structs.replace(req, train=msgspec.structs.replace(req.train, precision="bf16"))
        est = estimate(model, req, device)
        predicted = est.mib - est.overhead_mib  # what the measurement sees (the context is outside it)
        error = predicted / measured - 1
        errors.append(error)
        h, layers, _, _, _, vocab, tokens, ckpt, chunk, targets = shape
        print(
            f"{h:6} {layers:6} {vocab:7} {tokens:6} {str(ckpt):>5} {chunk:5} {targets:>4} {measured:9,.0f} "
            f"{predicted:9,} {error:+7.0%}   ({est.why()})"
        )
    print(
        f"error: mean {sum(errors) / len(errors):+.0%}, worst under {min(errors):+.0%}, worst over "
        f"{max(errors):+.0%} (positive: the estimate is above the real peak)"
    )
    promises = Guarantees()  # the scheduler places by the estimate: one far under a real peak is an OOM on a node
    promises.check(min(errors) >= -args.under, f"no estimate under its real peak by more than {args.under:.0%}")
    sys.exit(promises.verdict())


if __name__ == "__main__":
    main()
