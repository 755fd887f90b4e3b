"""An eval run (train.method eval): nothing is trained. Each item of the eval's rft dataset is answered `n` times by
the base model, or by it with the registered adapter the job names (init_adapter), sampled by the trainer itself
(transformers' generate: greedy at temperature 0), and graded by every criterion's grader. The results are written
one JSON line an item, then the summary (per grader: the mean, its 95% bootstrap interval, the pass rate), to
`<out>/eval/results.jsonl`, which the agent stores as the job's `eval` artifact."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from schemas.evals import EvalJob, ItemResult, summarize
from schemas.events import Finished, Started, TrainerSpec
from trainer import model as base
from trainer.errors import JobError
from trainer.events import emit
from trainer.objectives.rft import Prompts, read_prompts
from trainer.objectives.rollouts import complete, grade, grader_context, runnable, texts_of

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from services.graders import GraderContext
    from trainer.model import CausalLM

BATCH = 8  # prompts sampled at once

_enc = msgspec.json.Encoder()


def evaluate(spec: TrainerSpec) -> Finished:
    job = spec.request.evaluate
    if job is None or spec.dataset is None:
        raise JobError(
            "an eval run needs its evaluate part and a dataset the agent fetched: run it with `jetlora evals run`"
        )
    started = time.monotonic()
    context = grader_context(spec.out_dir)
    for c in job.criteria:
        runnable(c.grader, context)
    device = spec.device if spec.device == "cpu" or torch.cuda.is_available() else "cpu"
    t = spec.request.train
    tokenizer, loaded = base.load(spec.request.base_dir, device, base.pick_dtype(t.precision, device))
    model: CausalLM | PeftModel = loaded
    if spec.init_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(loaded, spec.init_adapter, is_trainable=False)
    model.eval()
    results = evaluate_items(model, tokenizer, job, spec.dataset.path, t.max_seq_length, context, device)
    summary = summarize(results, job.criteria)
    out = Path(spec.out_dir) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "wb") as f:
        for line in (*results, summary):
            f.write(_enc.encode(line) + b"\n")
    said = ", ".join(
        f"{g.name} {g.mean:.3f} [{g.low:.3f}, {g.high:.3f}] pass {g.pass_rate:.0%}" for g in summary.graders
    )
    return Finished(
        state="trained",
        step=0,
        adapter_dir=str(out),
        message=f"evaluated {len(results)} items in {time.monotonic() - started:.1f}s: {said}",
    )


def evaluate_items(
    model: CausalLM | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    job: EvalJob,
    dataset: str,
    max_seq_length: int,
    context: GraderContext,
    device: str,
) -> list[ItemResult]:
    """Every item of the rft dataset at `dataset` answered by `model` and graded: what an eval run stores (the gates'
    fault-injection test calls it in-process, on many adapters)."""
    room = max(1, max_seq_length - job.sampling.max_tokens)
    prompts = read_prompts(dataset, tokenizer, room, [c.grader for c in job.criteria])
    emit(Started(steps=0, examples=len(prompts), device=device, message=f"eval {job.eval}: {len(prompts)} items"))
    torch.manual_seed(job.sampling.seed)
    return [
        r
        for first in range(0, len(prompts), BATCH)
        for r in _batch(
            model,
            tokenizer,
            prompts.subset(range(first, min(first + BATCH, len(prompts)))),
            first,
            job,
            context,
            device,
        )
    ]


def _batch(
    model: CausalLM | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Prompts,
    first: int,
    job: EvalJob,
    context: GraderContext,
    device: str,
) -> list[ItemResult]:
    """Each prompt's n completions, graded by every criterion."""
    n, s = job.sampling.n, job.sampling
    repeated = [ids for ids in prompts.ids for _ in range(n)]
    temperature = s.temperature if s.temperature > 0 else None
    input_ids, _, completion_mask = complete(model, tokenizer, repeated, s.max_tokens, temperature, device)
    texts = texts_of(tokenizer, input_ids, completion_mask)
    items = [item for item in prompts.items for _ in range(n)]
    graded = {c.grader.name: (c, grade(c.grader, texts, items, context)) for c in job.criteria}
    results = []
    for i, item in enumerate(prompts.items):
        span = slice(i * n, (i + 1) * n)
        fields = {k: v for k, v in item.items() if k != "messages"}
        results.append(
            ItemResult(
                index=first + i,
                item=fields,
                input=[{"role": m["role"], "content": m["content"]} for m in item.get("messages", [])],
                outputs=texts[span],
                scores={name: [r.score for r in rs[span]] for name, (_, rs) in graded.items()},
                errors={name: [r.error for r in rs[span]] for name, (_, rs) in graded.items()},
                passed={name: [r.score >= c.threshold() for r in rs[span]] for name, (c, rs) in graded.items()},
            )
        )
    return results
