"""Where a co-training group's step spends its time (issue #64), against one job's step with the single-job trainer
(peft) on the same model and data as bench/co_train.py. torch.profiler over a few steps of each, in one process:
every op's own time is put under the innermost piece it ran in (labels put on the pieces from outside; no trainer
code changes), and each backward op under the piece its forward op ran in (autograd's sequence numbers link them).
The pieces: attention (the kernel calls, and around them the layout's reshapes, masks and concatenations), the
base linears, the LoRA matmuls (and the spreading of their rows), the loss through the output head, the optimizer
steps (clipping included), the layout of the batch, and the rest of the model (norms, activations, embeddings,
rotary). "python" is the time inside a piece that no op accounts for: the interpreter. Also each side's step
without the profiler (median of --steps, the sides taking turns step by step): the group's step against its K jobs'
steps one after another with the single-job trainer (each kind of job of --case timed alone), the ratio printed.

    python bench/co_train_profile.py [--ks 1,2,4,8 --steps 5 --threads 2 --case equal --profile-steps 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.guarantees import Guarantees  # noqa: E402

try:
    from bench import co_train_worker as bench  # noqa: E402
except ImportError:  # an older commit's tree (its bench/co_train.py held the jobs)
    from bench import co_train as bench  # type: ignore[no-redef]  # noqa: E402

PIECES = ["attn.kernel", "attn.layout", "mask", "base_linear", "lora", "lora.spread", "base+lora fused", "loss_head"]
PIECES += ["optimizer"]
PIECES += ["combine", "model.rest"]


def labelled(name: str, fn):
    import torch

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        with torch.profiler.record_function(f"@{name}"):
            return fn(*a, **kw)

    return wrapper


def label_common() -> None:
    """Labels both sides share: the attention kernel, the masks, the output head's loss, clipping and AdamW."""
    import torch
    import transformers.models.llama.modeling_llama as llama
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from trainer.objectives import losses

    for kernel in ("sdpa",):
        ALL_ATTENTION_FUNCTIONS[kernel] = labelled("attn.kernel", ALL_ATTENTION_FUNCTIONS[kernel])
    llama.create_causal_mask = labelled("mask", llama.create_causal_mask)
    losses.chunked_cross_entropy = labelled("loss_head", losses.chunked_cross_entropy)
    torch.nn.utils.clip_grad_norm_ = labelled("optimizer", torch.nn.utils.clip_grad_norm_)
    torch.optim.AdamW.step = labelled("optimizer", torch.optim.AdamW.step)


def label_group_code() -> None:
    """Labels on the group's code: its LoRA deltas and their spreading, the flat layout's attention, the batch's
    layout."""
    from transformers import AttentionInterface

    from trainer.co_train import combine, group as group_module

    from trainer.multi_lora import layer

    from trainer.multi_lora import varlen

    layer.MultiLoraLinear._add_deltas = labelled("lora", layer.MultiLoraLinear._add_deltas)
    if hasattr(layer.MultiLoraLinear, "_fused"):  # this tree's: the base linear and its LoRAs as one autograd step
        layer.MultiLoraLinear._fused = labelled("base+lora fused", layer.MultiLoraLinear._fused)
    for name in ("spread", "spans_delta", "indexed_delta", "with_spans"):  # an older tree's, and this one's
        if hasattr(layer, name):
            setattr(layer, name, labelled(f"lora.{name}", getattr(layer, name)))
    AttentionInterface.register(varlen.NAME, labelled("attn.layout", varlen._attention))
    group_module.combine = labelled("combine", combine.combine)


def label_group(group) -> None:
    for wrapped in group.base.wrapped.values():
        wrapped.base_layer.forward = labelled("base_linear", wrapped.base_layer.forward)
    decoder = group.base.model.get_decoder()
    decoder.forward = labelled("model.rest", decoder.forward)


def label_single(run) -> None:
    from peft.tuners.lora.layer import Linear as LoraLinear

    for module in run.model.modules():
        if isinstance(module, LoraLinear):
            module.base_layer.forward = labelled("base_linear", module.base_layer.forward)
            for inner in (module.lora_A["default"], module.lora_B["default"], module.lora_dropout["default"]):
                inner.forward = labelled("lora", inner.forward)
    decoder = run.model.get_base_model().get_decoder()
    decoder.forward = labelled("model.rest", decoder.forward)


def breakdown(prof) -> dict[str, float]:
    """ms of own time per piece (forward and backward), and 'python': time in labels that no op accounts for."""
    events = list(prof.events())
    piece_of_seq: dict[int, str] = {}

    def label_of(e) -> str | None:
        while e is not None:
            if e.name.startswith("@"):
                return e.name[1:]
            e = e.cpu_parent
        return None

    for e in events:  # forward ops: their sequence number -> their piece
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::"):
            piece_of_seq.setdefault(e.sequence_nr, label_of(e) or "model.rest")
    out: dict[str, float] = defaultdict(float)
    for e in events:
        own = e.self_cpu_time_total / 1000
        if e.name.startswith("@"):
            out[f"python.{e.name[1:]}"] += own
            continue
        node = e
        while node is not None and not node.name.startswith("autograd::engine::evaluate_function"):
            node = node.cpu_parent
        if node is not None:
            out[piece_of_seq.get(node.sequence_nr, "model.rest") + " (bwd)"] += own
        else:
            out[label_of(e) or "outside"] += own
    return out


def profiled(step, steps: int) -> dict[str, float]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {k: v / steps for k, v in breakdown(prof).items()}


def timed(steps: dict, n: int) -> dict:
    """Each side's median ms a step, the sides taking turns step by step (what else runs on the machine falls
    on every side alike)."""
    times = defaultdict(list)
    for _ in range(n):
        for side, step in steps.items():
            start = time.perf_counter()
            step()
            times[side].append(time.perf_counter() - start)
    return {side: statistics.median(t) * 1000 for side, t in times.items()}


def kind_of(index: int, args) -> tuple:
    return (*bench.shape_of(index, args), bench.rank_of(index, args))


def group_side(model_dir: str, k: int, args, tmp: str):
    import torch

    from trainer.co_train.group import CoTrainer
    from trainer.model import load

    tokenizer, model = load(model_dir, "cpu", torch.float32)
    group = CoTrainer(model, tokenizer, "cpu", torch.float32)
    for i in range(k):
        group.add_job(bench.job_spec(model_dir, f"{tmp}/g{k}/{i}", i, args))
    group.step()
    return group, group.step


def single_side(model_dir: str, args, tmp: str, index: int):
    from trainer.job.loop import optimizer_step
    from trainer.job.setup import prepare

    run = prepare(bench.job_spec(model_dir, f"{tmp}/single{index}", index, args))
    at = [0]

    def step():
        at[0] += 1
        optimizer_step(run, run.batches[at[0] % len(run.batches) : at[0] % len(run.batches) + 1])

    step()
    return run, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--case", choices=bench.CASES, default="equal", help="as bench/co_train.py's --cases")
    ap.add_argument("--profile-steps", type=int, default=3, help="profiled steps per side (0: only the wall times)")
    ap.add_argument("--target", type=float, default=1.2, help="group / serial promised at K >= 4 (issue #64)")
    args = ap.parse_args()
    args.pairs, args.precision, args.device, args.mixed_lengths = 300, "fp32", "cpu", False
    args.ranks, args.mixed_ranks = "8,16", "8,16,32,64"
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "deploy" / "demo"))
    from tinymodel import build

    with tempfile.TemporaryDirectory() as tmp:
        texts = [f"{p['q']} {p['a']}" for p in bench.make_pairs(500)]
        model_dir = str(build(Path(tmp) / "m", texts, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                              intermediate=3 * args.hidden, vocab_size=8000, init_range=0.02))  # fmt: skip
        ks = [int(x) for x in args.ks.split(",")]
        saved_steps, args.steps = args.steps, 1000  # the jobs' max_steps: never ending within the profile
        kinds = {kind_of(i, args): i for i in reversed(range(max(ks)))}  # each kind of job: its first index
        singles = {kind: single_side(model_dir, args, tmp, i) for kind, i in kinds.items()}
        groups = {k: group_side(model_dir, k, args, tmp) for k in ks}
        args.steps = saved_steps
        wall = timed(
            {kind: step for kind, (_, step) in singles.items()} | {k: s for k, (_, s) in groups.items()}, args.steps
        )
        serial = {k: sum(wall[kind_of(i, args)] for i in range(k)) for k in ks}
        print(f"{args.case}: ms a step, each kind of job alone (rows, seq, rank): " + ", ".join(
            f"{kind} {wall[kind]:.1f}" for kind in singles) + "; group / serial (its jobs' steps one after another): "
            + ", ".join(f"K={k} {serial[k] / wall[k]:.2f}x ({wall[k]:.0f} ms against {serial[k]:.0f})" for k in ks), flush=True)  # fmt: skip
        promises = Guarantees()
        for k in (k for k in ks if k >= 4):
            promises.check(serial[k] / wall[k] >= args.target, f"{args.case} K={k}: group / serial >= {args.target}x")
        if args.profile_steps:
            run, single = singles[kind_of(0, args)]
            label_common()
            label_group_code()
            label_single(run)
            for group, _ in groups.values():
                label_group(group)
            table = {"single": profiled(single, args.profile_steps)}
            table |= {k: profiled(s, args.profile_steps) for k, (_, s) in groups.items()}
            report({"single": wall[kind_of(0, args)]} | {k: wall[k] for k in ks}, table)
    sys.exit(promises.verdict())


def report(wall: dict, table: dict) -> None:
    keys = sorted({k for t in table.values() for k in t}, key=lambda k: (-table[max(table, key=str)].get(k, 0), k))
    sides = list(table)
    print(f"{'ms per step':28}" + "".join(f"{('K=' + str(s)) if s != 'single' else 'one job':>10}" for s in sides))
    print(f"{'wall, no profiler':28}" + "".join(f"{wall[s]:10.1f}" for s in sides))
    print(f"{'  per job':28}" + "".join(f"{wall[s] / (1 if s == 'single' else s):10.1f}" for s in sides))
    print(f"{'profiled, all ops':28}" + "".join(f"{sum(table[s].values()):10.1f}" for s in sides))
    for key in keys:
        print(f"{key:28}" + "".join(f"{table[s].get(key, 0):10.1f}" for s in sides))


if __name__ == "__main__":
    main()
