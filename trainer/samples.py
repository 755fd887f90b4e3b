"""What the adapter answers: greedy completions of a few prompts, by the adapter and once by the base model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from schemas.events import Sample, Samples
from schemas.job_status import PROBE_HEAD_TOKENS, PROBE_PROMPT, PROBE_TOKENS, Probe
from trainer.data.examples import Examples
from trainer.data.formats import IGNORE, prompt_text
from trainer.model import decoded, pad_id
from trainer.parity import parity_set
from trainer.objectives.rft import Prompts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer.model import GeneratingLM

AUTO_PROMPTS = 3


def sample_prompts(
    setting: list[str] | str, tokenizer: PreTrainedTokenizerBase, held_out: Examples, train_set: Examples
) -> list[tuple[str, list[int]]]:
    """(prompt as shown, its token ids with the model's template): the job's own prompts, or with `auto` the
    first held-out examples' prompts (the training ones when nothing is held out; grpo's prompts as they are)."""
    if not setting:
        return []
    if setting != "auto":
        return [(p, tokenizer(prompt_text(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in setting]
    source = held_out if len(held_out) else train_set
    if isinstance(source, Prompts):  # grpo's: the prompts as they are answered
        return list(zip(source.shown, source.ids))[:AUTO_PROMPTS]
    out = []
    for i in range(min(AUTO_PROMPTS, len(source))):
        ids, targets = source[i]
        learnt = [n for n, t in enumerate(targets) if t != IGNORE]
        prompt_ids = [int(t) for t in ids[: learnt[0] + 1]] if learnt else [int(t) for t in ids]
        out.append((decoded(tokenizer, prompt_ids).strip(), prompt_ids))
    return out


@torch.no_grad()
def answers(
    model: GeneratingLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[tuple[str, list[int]]],
    device: str,
    max_tokens: int,
) -> list[Sample]:
    was_training = model.training
    model.eval()
    out = []
    for shown, ids in prompts:
        inputs = torch.tensor([ids], device=device)
        generated = model.generate(
            input_ids=inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
        )
        out.append(Sample(prompt=shown, answer=decoded(tokenizer, generated[0, len(ids) :])))
    if was_training:
        model.train()
    return out


def samples_event(
    model: GeneratingLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[tuple[str, list[int]]],
    device: str,
    max_tokens: int,
    step: int,
    base: bool = False,
) -> Samples:
    if base:
        with model.disable_adapter():
            return Samples(step=step, model="base", samples=answers(model, tokenizer, prompts, device, max_tokens))
    return Samples(step=step, model="adapter", samples=answers(model, tokenizer, prompts, device, max_tokens))


@torch.no_grad()
def probe(model: GeneratingLM, tokenizer: PreTrainedTokenizerBase, device: str, base: bool = True) -> Probe:
    """The adapter's greedy answer to PROBE_PROMPT, tokenized as an engine's completions API does (special tokens
    added) and decoded in the prompt's context, as an engine streams it (a first token's leading space kept); with
    the probe set's log-probabilities for parity (trainer/parity.py; `base`: with the adapter off too)."""
    was_training = model.training
    model.eval()
    ids = tokenizer(PROBE_PROMPT)["input_ids"]
    inputs = torch.tensor([ids], device=device)
    out = model.generate(
        input_ids=inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=PROBE_TOKENS,
        do_sample=False,
        pad_token_id=pad_id(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
    )[0].tolist()
    if was_training:
        model.train()

    def continuation(n: int) -> str:
        shown = decoded(tokenizer, ids)
        return decoded(tokenizer, out[: len(ids) + n])[len(shown) :]

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Probe(
        prompt=PROBE_PROMPT,
        text=continuation(PROBE_TOKENS),
        head=continuation(PROBE_HEAD_TOKENS),
        dtype=dtype,
        parity=parity_set(model, tokenizer, device, base),
    )
