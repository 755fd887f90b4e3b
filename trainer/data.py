"""Q/A pairs to token ids and labels, then to batches: packed without padding, or padded."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from trainer.errors import JobError

IGNORE = -100
PLAIN_TEMPLATE = "### Question:\n{q}\n\n### Answer:\n"


@dataclass
class Example:
    ids: list[int]
    targets: list[int]  # already shifted: targets[t] is the token to predict after ids[t]; IGNORE where none


def prompt_text(tokenizer, question: str) -> str:
    """The model's chat template when it has one, else a plain question/answer template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    return (tokenizer.bos_token or "") + PLAIN_TEMPLATE.format(q=question)


def encode(tokenizer, pairs, max_seq_length: int, completions_only: bool = True) -> list[Example]:
    if tokenizer.eos_token_id is None:
        raise JobError("the tokenizer has no eos token; add one to tokenizer_config.json so answers can end")
    out = []
    for n, pair in enumerate(pairs):
        prompt = tokenizer(prompt_text(tokenizer, pair.q), add_special_tokens=False)["input_ids"]
        answer = tokenizer(pair.a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(prompt) >= max_seq_length:
            raise JobError(f"data[{n}]: the question takes {len(prompt)} tokens with its template, max_seq_length is "
                           f"{max_seq_length}; raise train.max_seq_length or shorten the question")
        ids = (prompt + answer)[:max_seq_length]
        labels = ([IGNORE] * len(prompt) if completions_only else list(prompt)) + answer
        labels = labels[:max_seq_length]
        out.append(Example(ids=ids, targets=labels[1:] + [IGNORE]))
    return out


def split(examples: list[Example], eval_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    if not eval_fraction:
        return examples, []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, int(len(examples) * eval_fraction))
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in order[:n_eval]]


@dataclass
class Batch:
    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    tokens: int  # real tokens in the batch (no padding)

    def to(self, device) -> "Batch":
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return Batch(move(self.input_ids), move(self.targets), move(self.position_ids), move(self.attention_mask),
                     self.tokens)


def packed_batches(examples: list[Example], tokens_per_batch: int, seed: int) -> list[Batch]:
    """Each batch is one row of whole examples back to back, positions restarting at each one.

    transformers sees position ids that restart and no attention mask, and builds a
    block-diagonal causal mask (or the varlen path on flash attention): no example
    attends to another, and no FLOP is spent on padding.
    """
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    batches, row = [], []
    used = 0
    for i in order:
        ex = examples[i]
        if row and used + len(ex.ids) > tokens_per_batch:
            batches.append(_pack(row))
            row, used = [], 0
        row.append(ex)
        used += len(ex.ids)
    if row:
        batches.append(_pack(row))
    return batches


def _pack(row: list[Example]) -> Batch:
    ids = [t for ex in row for t in ex.ids]
    targets = [t for ex in row for t in ex.targets]
    positions = [p for ex in row for p in range(len(ex.ids))]
    return Batch(torch.tensor([ids]), torch.tensor([targets]), torch.tensor([positions]), None, len(ids))


def padded_batches(examples: list[Example], batch_size: int, seed: int, pad_id: int) -> list[Batch]:
    """The usual way: batch_size examples per batch, right-padded to the longest."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    batches = []
    for start in range(0, len(order), batch_size):
        group = [examples[i] for i in order[start:start + batch_size]]
        width = max(len(ex.ids) for ex in group)
        ids = torch.full((len(group), width), pad_id)
        targets = torch.full((len(group), width), IGNORE)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for r, ex in enumerate(group):
            ids[r, :len(ex.ids)] = torch.tensor(ex.ids)
            targets[r, :len(ex.ids)] = torch.tensor(ex.targets)
            mask[r, :len(ex.ids)] = 1
        batches.append(Batch(ids, targets, None, mask, sum(len(ex.ids) for ex in group)))
    return batches


def make_batches(examples, train_cfg, pad_id: int, epoch: int) -> list[Batch]:
    seed = train_cfg.seed + epoch
    if train_cfg.packing:
        return packed_batches(examples, train_cfg.batch_size * train_cfg.max_seq_length, seed)
    return padded_batches(examples, train_cfg.batch_size, seed, pad_id)
