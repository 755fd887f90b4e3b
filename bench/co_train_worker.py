"""One process of a side of bench/co_train.py: `base` loads the model only; `single` trains one job with jetlora's
single-job trainer (trainer.job.setup.prepare and loop.optimizer_step: peft); `group` (and `padded`, its rows padded to
the widest member's) trains jobs 0..k-1 as one co-training group. Each loads, takes one warm-up step, says READY
and waits for `go` on stdin, so that every process of a side starts its clock at once; its result is one
`RESULT {json}` line: the real tokens it trained, its clock, its peak memory."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "the model learns short answers about rivers cities mountains languages and the history of places".split()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LONG = 8  # the mixed-lengths case: job 0's row is this many times --seq
CASES = ("equal", "mixed-lengths", "mixed-ranks")


def make_pairs(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [
        {
            "q": " ".join(rng.choices(WORDS, k=rng.randint(4, 16))) + "?",
            "a": " ".join(rng.choices(WORDS, k=rng.randint(8, 60))),
        }
        for _ in range(n)
    ]


def shape_of(index: int, args) -> tuple[int, int]:
    """(rows, max_seq_length) of job `index`'s steps: in the mixed-lengths case job 0 takes one long row."""
    return (1, LONG * args.seq) if args.case == "mixed-lengths" and index == 0 else (args.rows, args.seq)


def rank_of(index: int, args) -> int:
    """Job `index`'s LoRA rank: the case's ranks in turn (--mixed-ranks in the mixed-ranks case, else --ranks)."""
    ranks = [int(r) for r in (args.mixed_ranks if args.case == "mixed-ranks" else args.ranks).split(",")]
    return ranks[index % len(ranks)]


def job_request(model_dir: str, index: int, args) -> dict:
    rows, seq = shape_of(index, args)
    return {
        "model": "bench",
        "base_dir": model_dir,
        "data": make_pairs(args.pairs),
        "lora": {"r": rank_of(index, args), "alpha": 32, "target_modules": TARGETS},
        "train": {
            "max_steps": args.steps + 1,
            "learning_rate": 1e-3,
            "batch_size": rows,
            "max_seq_length": seq,
            "precision": args.precision,
            "warmup_steps": 0,
            "seed": 100 + index,
        },
    }


def job_spec(model_dir: str, out: str, index: int, args):
    """Job `index` of a side: its own seed (data order, adapter start), rank and shape; the rest as every job's."""
    import msgspec

    from schemas.events import TrainerSpec
    from schemas.jobs import JobRequest

    request = job_request(model_dir, index, args)
    return TrainerSpec(
        job=f"job{index}", attempt=1, request=msgspec.convert(request, JobRequest), out_dir=out, device=args.device
    )


def peak_mib(device: str = "cpu") -> float:
    """The process's peak: resident memory on the CPU (VmHWM: this process image's own; ru_maxrss would carry the
    bench's own process's, which built the model, across exec); on a GPU, what torch allocated at most (the CUDA
    context, the same for every process, left out)."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def wait_for_go() -> None:
    print("READY", flush=True)
    sys.stdin.readline()


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def worker(args) -> dict:
    """This process's side of the run, as args.worker says."""
    import torch

    from trainer.model import pick_dtype

    torch.set_num_threads(max(1, args.threads))
    dtype = pick_dtype(args.precision, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.worker == "base":
            from trainer.model import load

            load(args.model, args.device, dtype)
            wait_for_go()
            return {"peak_mib": peak_mib(args.device)}
        if args.worker == "single":
            return single_job(job_spec(args.model, tmp, args.index, args), args.steps)
        specs = [job_spec(args.model, f"{tmp}/{i}", i, args) for i in range(args.k)]
        return group_of(args.model, specs, args.steps, args.device, dtype, args.worker == "group")


def single_job(spec, steps: int) -> dict:
    from trainer.job.loop import optimizer_step
    from trainer.job.setup import prepare

    run = prepare(spec)
    optimizer_step(run, run.batches[0:1])  # warm-up
    tokens = run.at.tokens
    wait_for_go()
    start = time.time()
    for i in range(1, steps + 1):
        optimizer_step(run, run.batches[i : i + 1])
    sync(spec.device)
    return {"tokens": run.at.tokens - tokens, "start": start, "end": time.time(), "peak_mib": peak_mib(spec.device)}


def group_of(model_dir: str, specs: list, steps: int, device: str, dtype, flat: bool = True) -> dict:
    import torch

    from trainer.co_train.group import CoTrainer
    from trainer.model import load

    tokenizer, model = load(model_dir, device, dtype)
    group = CoTrainer(model, tokenizer, device, dtype if device == "cuda" else torch.float32, flat=flat)
    for spec in specs:
        group.add_job(spec)
    group.step()  # warm-up
    wait_for_go()
    start = time.time()
    results = [group.step() for _ in range(steps)]
    sync(device)
    tokens = sum(r.tokens for step in results for r in step.values())
    return {"tokens": tokens, "start": start, "end": time.time(), "peak_mib": peak_mib(device)}
