"""Many adapters, one base (trainer/co_train): K jobs on the same base trained as one group in one process,
against K separate trainer processes running at once (each with its share of the cores, or sharing the GPU with
--device cuda), and against K trainer processes one after another (each with all of them). The separate processes
are jetlora's own single-job trainer (trainer.job.setup.prepare and loop.optimizer_step: peft); every side trains the
same K jobs (their own seeds, data orders and ranks) for the same steps (bench/co_train_worker.py: one process of
a side). Each process loads the model, takes one warm-up step, then waits until every process of its side is
ready; the clock runs from then on. The sides rotate round by round (FACTS: a benchmark that runs its baseline and
then its own side measures the machine's load, not itself). Reported: aggregate real tokens/s (median and spread
over rounds), the ratios group / separate and group / serial measured in the same rounds, and peak memory: the
group's against base + each job's own state + 10% (`base`: a process that only loads the model; a job's own state:
its single-job trainer's peak less that) and against the scheduler's group estimate (schemas/co_train.py
group_estimate) + 10%. Those two bounds are the guarantees it prints: it exits 1 when a peak is over either.

Cases (--cases, each a row per K):
  equal          every job --rows rows of --seq tokens a step, ranks --ranks in turn (8 and 16)
  mixed-lengths  job 0 one row of 8 x --seq tokens a step beside the short ones (issue #54); the group's peak is
                 also measured with its rows padded to the widest member's (CoTrainer(flat=False)), for the difference
  mixed-ranks    as equal, ranks --mixed-ranks in turn (8, 16, 32, 64 in one group)

On the CPU, workers run with glibc's MALLOC_MMAP_THRESHOLD_ at 128 KiB, so that a process's peak RSS is what its
tensors held, not what the allocator kept after freeing them. Run by hand:

    python bench/co_train.py [--ks 2,4,8 --rounds 3 --steps 5 --cases equal,mixed-lengths,mixed-ranks]

Each process times a few steps after one warm-up step, so on a shared 2-core machine its ratios spread widely (one
run, K = 4: group / serial 1.8-3.4x): bench/co_train_profile.py times the same jobs' steps in one process, the
sides taking turns step by step, and holds group / serial to its target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.co_train_worker import CASES, LONG, job_request, make_pairs, rank_of, shape_of, worker  # noqa: E402

SIDES = ("group", "separate", "serial")
ALLOWANCE = 1.10  # a peak may be this much over its bound before the bench calls it broken


def launch(args, model_dir: str, kind: str, threads: int, **extra) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", kind, "--model", model_dir, "--threads", str(threads)]
    cmd += ["--steps", str(args.steps), "--rows", str(args.rows), "--seq", str(args.seq), "--pairs", str(args.pairs)]
    cmd += ["--device", args.device, "--precision", args.precision, "--case", args.case]
    cmd += ["--ranks", args.ranks, "--mixed-ranks", args.mixed_ranks]
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


def cores_of(args) -> int:
    return args.threads or os.cpu_count() or 1


def side(args, model_dir: str, name: str, k: int) -> dict:
    """One side's run: aggregate tokens/s over its clock, and its largest process's peak memory."""
    cores = cores_of(args)
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


def kind_of(index: int, args) -> tuple:
    """What a job's own state depends on here: its shape and rank."""
    return (*shape_of(index, args), rank_of(index, args))


def own_states(args, model_dir: str, base_mib: float, k: int) -> dict[tuple, float]:
    """Each kind of job among the first k: its single-job trainer's peak less a process that only loads the model."""
    first = {}
    for i in range(k):
        first.setdefault(kind_of(i, args), i)
    return {
        kind: together([launch(args, model_dir, "single", cores_of(args), index=i)])[0]["peak_mib"] - base_mib
        for kind, i in first.items()
    }


def ratios(rounds: list[dict], other: str) -> tuple[float, float, float] | None:
    """group / other over the rounds: median, lowest, highest (None: that side was not run)."""
    if other not in rounds[0]:
        return None
    got = sorted(x["group"]["tokens_per_s"] / x[other]["tokens_per_s"] for x in rounds)
    return statistics.median(got), got[0], got[-1]


def compare(args, model_dir: str, k: int, base_mib: float, own: dict[tuple, float]) -> dict:
    """The sides (--sides) at K, round by round; the row of the summary, with the guarantees it checked."""
    sides = args.sides.split(",")
    rounds = []
    for r in range(args.rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        rounds.append({name: side(args, model_dir, name, k) for name in order})
        print(
            f"  {args.case} K={k} round {r + 1} ({' '.join(order)}): "
            + ", ".join(f"{n} {rounds[-1][n]['tokens_per_s']:6.0f} tok/s" for n in sides),
            flush=True,
        )
    row = {"case": args.case, "k": k} | {other: ratios(rounds, other) for other in ("serial", "separate")}
    tps = {n: statistics.median(x[n]["tokens_per_s"] for x in rounds) if n in sides else 0.0 for n in SIDES}
    group_peak = max(x["group"]["peak_mib"] for x in rounds)
    owns = sum(own[kind_of(i, args)] for i in range(k))
    estimated = sum(group_estimate(args, model_dir, k).own_mib)
    grew = group_peak - base_mib  # the jobs' part: what a process that only loads the model does not hold
    row |= {"grew": grew, "owns": owns, "estimated": estimated, "separate_sum": 0.0, "padded": None}
    if "separate" in sides:
        row["separate_sum"] = statistics.median(x["separate"]["sum_peak_mib"] for x in rounds)
    kind = "allocated" if args.device == "cuda" else "RSS"
    print(
        f"{args.case} K={k}: group / serial {fmt(row['serial'])}, group / separate {fmt(row['separate'])}; median tok/s"
        f" group {tps['group']:.0f}, separate {tps['separate']:.0f}, serial {tps['serial']:.0f}; group peak {kind} "
        f"{group_peak:.0f} MiB, {grew:.0f} over the base's, against the jobs' own states alone + 10% = "
        f"{ALLOWANCE * owns:.0f} MiB ({within(grew, owns)}) and the group estimate's own parts + 10% = "
        f"{ALLOWANCE * estimated:.0f} MiB ({within(grew, estimated)}); separate processes' peaks add up to "
        f"{row['separate_sum']:.0f} MiB",
        flush=True,
    )
    if args.case == "mixed-lengths":
        padded = together([launch(args, model_dir, "padded", cores_of(args), k=k)])[0]
        row["padded"] = padded["peak_mib"] - base_mib
        print(
            f"{args.case} K={k}, rows padded to the widest member (as before #54): {row['padded']:.0f} MiB over the base's"
        )
    return row


def fmt(ratio: tuple[float, float, float] | None) -> str:
    if ratio is None:
        return "-"
    return f"{ratio[0]:.2f}x ({ratio[1]:.2f}-{ratio[2]:.2f})"


def within(grew: float, bound: float) -> str:
    return "within" if grew <= ALLOWANCE * bound else "OVER"


def group_estimate(args, model_dir: str, k: int):
    """The scheduler's estimate of the group's peak (schemas/co_train.py), on this device kind."""
    import msgspec

    from schemas.co_train import group_estimate as estimate
    from schemas.jobs import JobRequest
    from services.agent.models import read_shape

    requests = [msgspec.convert(job_request(model_dir, i, args), JobRequest) for i in range(k)]
    return estimate(read_shape(model_dir), requests, args.device)


def summary(rows: list[dict]) -> bool:
    """The rows as one table; whether every peak was within both bounds."""
    print("\n| case | K | group / serial | group / separate | group's own MiB | own states + 10% | estimate + 10% |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        held = within(r["grew"], r["owns"]) == within(r["grew"], r["estimated"]) == "within"
        ok = ok and held
        print(
            f"| {r['case']} | {r['k']} | {fmt(r['serial'])} | {fmt(r['separate'])} | {r['grew']:.0f} | "
            f"{ALLOWANCE * r['owns']:.0f} ({within(r['grew'], r['owns'])}) | "
            f"{ALLOWANCE * r['estimated']:.0f} ({within(r['grew'], r['estimated'])}) |"
        )
    if not ok:
        print("BROKEN: a group's peak is over its bound (the jobs' own states alone, or the scheduler's estimate)")
    return ok


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="2,4,8", help="group sizes to compare")
    ap.add_argument("--cases", default=",".join(CASES), help=f"rows per K, of {', '.join(CASES)}")
    ap.add_argument("--ranks", default="8,16", help="LoRA ranks of the equal and mixed-lengths cases, in turn")
    ap.add_argument("--mixed-ranks", default="8,16,32,64", help="LoRA ranks of the mixed-ranks case, in turn")
    ap.add_argument("--sides", default=",".join(SIDES), help="sides to run: group and which baselines")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per K; the sides' order rotates each round")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per job (after one warm-up step)")
    ap.add_argument("--rows", type=int, default=2, help="packed rows per job per step")
    ap.add_argument("--seq", type=int, default=256, help="max_seq_length: tokens per packed row")
    ap.add_argument("--pairs", type=int, default=300, help="Q/A pairs per job")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: on a GPU (bench/gpu_check.py)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads a side may use (0: the cores): the group and each serial process use them all, each of K "
        "separate processes its K-th share (at least 1)",
    )
    ap.add_argument("--worker", choices=["base", "single", "group", "padded"], help=argparse.SUPPRESS)
    ap.add_argument("--case", choices=CASES, default="equal", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        ap.error(f"--cases {','.join(sorted(unknown))}: choose among {', '.join(CASES)}")
    sides = args.sides.split(",")
    if "group" not in sides or set(sides) - set(SIDES) or len(sides) < 2:
        ap.error(f"--sides {args.sides}: group and at least one of separate, serial")
    return args


def main() -> None:
    args = parse()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    sys.path.insert(0, str(ROOT / "deploy" / "demo"))
    from tinymodel import build

    ks = [int(x) for x in args.ks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        texts = [f"{p['q']} {p['a']}" for p in make_pairs(500)]
        model_dir = str(build(Path(tmp) / "m", texts, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                              intermediate=3 * args.hidden, vocab_size=8000, init_range=0.02))  # fmt: skip
        size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**20
        base_mib = together([launch(args, model_dir, "base", cores_of(args))])[0]["peak_mib"]
        print(
            f"model {size:.0f} MiB of weights (hidden {args.hidden}, {args.layers} layers); {cores_of(args)} threads a "
            f"side, load {os.getloadavg()[0]:.1f}; each job {args.rows} packed rows of {args.seq} tokens a step (the "
            f"mixed-lengths case: job 0 one row of {LONG * args.seq}), LoRA on every linear layer; {args.steps} timed "
            f"steps; a process that loads the model peaks at {base_mib:.0f} MiB",
            flush=True,
        )
        for case in args.cases.split(","):
            args.case = case
            own = own_states(args, model_dir, base_mib, max(ks))
            print(f"{case}: each kind of job's own state (rows, seq, rank: MiB): {own}", flush=True)
            rows += [compare(args, model_dir, k, base_mib, own) for k in ks]
    if not summary(rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
