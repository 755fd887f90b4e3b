"""Many adapters, one base (trainer/co_train): K jobs on the same base trained as one group in one process,
against K separate trainer processes running at once (each with its share of the cores, or sharing the GPU with
--device cuda), and against K trainer processes one after another (each with all of them). The separate processes
are jetlora's own single-job trainer (trainer.job.setup.prepare and loop.optimizer_step: peft); every side trains the
same K jobs (their own seeds, data orders and ranks) for the same steps. Each process loads the model, takes one
warm-up step, then waits until every process of its side is ready; the clock runs from then on. The sides rotate
round by round (FACTS: a benchmark that runs its baseline and then its own side measures the machine's load, not
itself). Reported: aggregate real tokens/s (median and spread over rounds), the ratios group / separate and
group / serial measured in the same rounds, and peak memory: the group's against base + each job's own state
+ 10% (`base`: a process that only loads the model; a job's own state: its single-job trainer's peak less that)
and against the scheduler's group estimate (schemas/co_train.py group_estimate).

--mixed-lengths: job 0 of each side takes one row of 8 x --seq tokens a step, the others --rows rows of --seq (one
long job beside short ones, issue #54); the group's peak is also measured with its rows padded to the widest
member's (CoTrainer(flat=False), as groups were before), for the difference. On the CPU, workers run with glibc's
MALLOC_MMAP_THRESHOLD_ at 128 KiB, so that a process's peak RSS is what its tensors held, not what the allocator
kept after freeing them. Run by hand:

    python bench/co_train.py [--ks 1,2,4,8 --rounds 3 --steps 5] [--mixed-lengths]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "the model learns short answers about rivers cities mountains languages and the history of places".split()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "q": " ".join(rng.choices(WORDS, k=rng.randint(4, 16))) + "?",
            "a": " ".join(rng.choices(WORDS, k=rng.randint(8, 60))),
        }
        for _ in range(n)
    ]


LONG = 8  # --mixed-lengths: job 0's row is this many times --seq


def shape_of(index: int, args) -> tuple[int, int]:
    """(rows, max_seq_length) of job `index`'s steps."""
    return (1, LONG * args.seq) if args.mixed_lengths and index == 0 else (args.rows, args.seq)


def job_request(model_dir: str, index: int, args) -> dict:
    rows, seq = shape_of(index, args)
    return {
        "model": "bench",
        "base_dir": model_dir,
        "data": make_pairs(args.pairs),
        "lora": {"r": (8, 16)[index % 2], "alpha": 32, "target_modules": TARGETS},
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
    """Job `index` of a side: its own seed (data order, adapter start) and rank; the rest as every job's."""
    import msgspec

    from schemas.events import TrainerSpec
    from schemas.jobs import JobRequest

    request = job_request(model_dir, index, args)
    return TrainerSpec(
        job=f"job{index}", attempt=1, request=msgspec.convert(request, JobRequest), out_dir=out, device=args.device
    )


def peak_mib(device: str = "cpu") -> float:
    """The process's peak: resident memory on the CPU; on a GPU, what torch allocated at most (the CUDA context,
    the same for every process, left out)."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def wait_for_go() -> None:
    print("READY", flush=True)
    sys.stdin.readline()


def worker(args) -> dict:
    """One process of a side: `base` loads the model only; `single` trains job args.index with the single-job
    trainer; `group` trains jobs 0..k-1 as one group."""
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


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


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


def launch(args, model_dir: str, kind: str, threads: int, **extra) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", kind, "--model", model_dir, "--threads", str(threads)]
    cmd += ["--steps", str(args.steps), "--rows", str(args.rows), "--seq", str(args.seq), "--pairs", str(args.pairs)]
    cmd += ["--device", args.device, "--precision", args.precision] + (
        ["--mixed-lengths"] if args.mixed_lengths else []
    )
    for key, value in extra.items():
        cmd += [f"--{key}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def together(procs: list[subprocess.Popen]) -> list[dict]:
    """Start the clock of every process at once (each has loaded and warmed up), and collect their results."""
    for p in procs:
        while (line := p.stdout.readline()) and line.strip() != "READY":
            pass
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        lines = p.communicate()[0].splitlines()
        if p.returncode:
            raise RuntimeError(f"a worker failed ({p.returncode}); run it by hand to see why: {p.args}")
        out.append(json.loads(next(line for line in lines[::-1] if line.startswith("RESULT "))[7:]))
    return out


def side(args, model_dir: str, name: str, k: int) -> dict:
    """One side's run: aggregate tokens/s over its clock, and its largest process's peak memory."""
    cores = args.threads or os.cpu_count() or 1
    if name == "group":
        runs = together([launch(args, model_dir, "group", cores, k=k)])
        seconds = runs[0]["end"] - runs[0]["start"]
    elif name == "separate":
        runs = together([launch(args, model_dir, "single", max(1, cores // k), index=i) for i in range(k)])
        seconds = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    else:  # one after another
        runs = [together([launch(args, model_dir, "single", cores, index=i)])[0] for i in range(k)]
        seconds = sum(r["end"] - r["start"] for r in runs)
    return {
        "tokens_per_s": sum(r["tokens"] for r in runs) / seconds,
        "peak_mib": max(r["peak_mib"] for r in runs),
        "sum_peak_mib": sum(r["peak_mib"] for r in runs),
    }


def compare(args, model_dir: str, k: int, base_mib: float, own_mib: dict[int, float]) -> None:
    sides = ["group", "separate", "serial"]
    rounds = []
    for r in range(args.rounds):
        order = sides[r % 3 :] + sides[: r % 3]
        rounds.append({name: side(args, model_dir, name, k) for name in order})
        print(
            f"  K={k} round {r + 1} ({' '.join(order)}): "
            + ", ".join(f"{n} {rounds[-1][n]['tokens_per_s']:6.0f} tok/s" for n in sides),
            flush=True,
        )
    what = "mixed lengths" if args.mixed_lengths else "equal lengths"
    for other in ("separate", "serial"):
        ratios = sorted(x["group"]["tokens_per_s"] / x[other]["tokens_per_s"] for x in rounds)
        print(
            f"K={k}, {what}: group / {other}: median {statistics.median(ratios):.2f}x "
            f"({ratios[0]:.2f}-{ratios[-1]:.2f})"
        )
    tps = {n: statistics.median(x[n]["tokens_per_s"] for x in rounds) for n in sides}
    group_peak = max(x["group"]["peak_mib"] for x in rounds)
    owns = [own_mib[min(i, 1) if args.mixed_lengths else 1] for i in range(k)]
    separate_sum = statistics.median(x["separate"]["sum_peak_mib"] for x in rounds)
    estimated = sum(group_estimate(args, model_dir, k).own_mib)
    kind = "allocated" if args.device == "cuda" else "RSS"
    grew = group_peak - base_mib  # the jobs' part: what a process that only loads the model does not hold
    print(
        f"K={k}, {what}: median tok/s group {tps['group']:.0f}, separate {tps['separate']:.0f}, serial "
        f"{tps['serial']:.0f}; group peak {kind} {group_peak:.0f} MiB, {grew:.0f} MiB over the base's, against the "
        f"jobs' own states alone + 10% = {1.1 * sum(owns):.0f} MiB ({'within' if grew <= 1.1 * sum(owns) else 'OVER'})"
        f" and the group estimate's own parts + 10% = {1.1 * estimated:.0f} MiB "
        f"({'within' if grew <= 1.1 * estimated else 'OVER'}); separate processes' peaks add up to "
        f"{separate_sum:.0f} MiB",
        flush=True,
    )
    if args.mixed_lengths:
        padded = together([launch(args, model_dir, "padded", args.threads or os.cpu_count() or 1, k=k)])[0]
        print(
            f"K={k}, mixed lengths, rows padded to the widest member (as before #54): peak {padded['peak_mib']:.0f} "
            f"MiB, {padded['peak_mib'] - base_mib:.0f} over the base's",
            flush=True,
        )


def group_estimate(args, model_dir: str, k: int):
    """The scheduler's estimate of the group's peak (schemas/co_train.py), on this device kind."""
    import msgspec

    from schemas.co_train import group_estimate as estimate
    from schemas.jobs import JobRequest
    from services.agent.models import read_shape

    requests = [msgspec.convert(job_request(model_dir, i, args), JobRequest) for i in range(k)]
    return estimate(read_shape(model_dir), requests, args.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="1,2,4,8", help="group sizes to compare")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per K; the sides' order rotates each round")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per job (after one warm-up step)")
    ap.add_argument("--rows", type=int, default=2, help="packed rows per job per step")
    ap.add_argument("--seq", type=int, default=256, help="max_seq_length: tokens per packed row")
    ap.add_argument("--pairs", type=int, default=300, help="Q/A pairs per job")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: on a GPU (bench/gpu_check.py)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--mixed-lengths", action="store_true", help="job 0 of each side: 1 row of 8 x --seq a step")
    ap.add_argument("--worker", choices=["base", "single", "group", "padded"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads a side may use (0: the cores): the group and each serial process use them all, each of K "
        "separate processes its K-th share (at least 1)",
    )
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    sys.path.insert(0, str(ROOT / "deploy" / "demo"))
    from tinymodel import build

    with tempfile.TemporaryDirectory() as tmp:
        texts = [f"{p['q']} {p['a']}" for p in make_pairs(500)]
        model_dir = str(build(Path(tmp) / "m", texts, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                              intermediate=3 * args.hidden, vocab_size=8000, init_range=0.02))  # fmt: skip
        size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**20
        cores = args.threads or os.cpu_count() or 1
        base_mib = together([launch(args, model_dir, "base", cores)])[0]["peak_mib"]
        singles = (0, 1) if args.mixed_lengths else (1,)  # job 0 (the long one) and one short one
        own = {
            i: together([launch(args, model_dir, "single", cores, index=i)])[0]["peak_mib"] - base_mib for i in singles
        }
        long = f"; job 0: 1 row of {LONG * args.seq} tokens" if args.mixed_lengths else ""
        print(
            f"model {size:.0f} MiB of weights (hidden {args.hidden}, {args.layers} layers); {cores} threads a side, load "
            f"{os.getloadavg()[0]:.1f}; each job {args.rows} packed rows of {args.seq} tokens a step{long}, r 8 or 16 "
            f"on every linear layer; {args.steps} timed steps; a process that loads the model peaks at "
            f"{base_mib:.0f} MiB; a job's own state (its single-job trainer's peak less that): "
            + ", ".join(f"job {i} {mib:.0f} MiB" for i, mib in own.items()),
            flush=True,
        )
        for k in (int(x) for x in args.ks.split(",")):
            compare(args, model_dir, k, base_mib, own)


if __name__ == "__main__":
    main()
