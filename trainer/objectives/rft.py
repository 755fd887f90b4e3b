"""An rft dataset's prompts, what grpo samples its completions from: each row as its grader reads it (the `item`)
and its conversation rendered with the model's chat template, ready for the answer (the generation prompt).

Rows are few and short next to sft's (a prompt each, no answers), so they are read whole into memory: no token
cache."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from schemas.dataset_check import UTF8_BOM
from schemas.datasets import RftRow
from trainer.errors import JobError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from schemas.events import TrainerSpec

_rows = msgspec.json.Decoder(RftRow)
_items = msgspec.json.Decoder(dict)
_ITEM_FIELD = re.compile(r"\{\{\s*item\.([A-Za-z0-9_]+)")


@dataclass
class Prompts:
    """Prompts to sample from: ids[i] is prompt i's token ids, items[i] its row, shown[i] its last user message."""

    ids: list[list[int]]
    items: list[dict]
    shown: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, positions) -> "Prompts":
        return Prompts(
            [self.ids[int(i)] for i in positions],
            [self.items[int(i)] for i in positions],
            [self.shown[int(i)] for i in positions],
        )


def read_prompts(path: str, tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int, grader) -> Prompts:
    """The file's rows rendered for answering; a row the grader would miss a field of, or too long to leave room for
    the completion, is a JobError naming its line."""
    if not getattr(tokenizer, "chat_template", None):
        raise JobError(
            "rft data is rendered with the model's chat template, and this tokenizer has none: add chat_template to "
            "the model's tokenizer_config.json"
        )
    needed = sorted(set(_ITEM_FIELD.findall(msgspec.json.encode(grader).decode())))
    prompts = Prompts([], [], [])
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            line = line.removeprefix(UTF8_BOM) if line_no == 1 else line
            if not line.strip():
                continue
            row, item = _rows.decode(line), _items.decode(line)
            if missing := [name for name in needed if name not in item]:
                raise JobError(
                    f"line {line_no:,} of the dataset has no {', '.join(missing)}, which train.grader reads as "
                    "{{item.<field>}}: add the field to every row, or fix the grader's template"
                )
            messages = [{"role": m.role, "content": m.content} for m in row.messages]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_tokens:
                raise JobError(
                    f"line {line_no:,}: the prompt takes {len(ids)} tokens with its template, and train.max_seq_length "
                    f"less train.max_completion_tokens leaves {max_prompt_tokens}; raise max_seq_length or shorten it"
                )
            prompts.ids.append(ids)
            prompts.items.append(item)
            prompts.shown.append(row.messages[-1].content)
    return prompts


def split(prompts: Prompts, eval_fraction: float, seed: int) -> tuple[Prompts, Prompts]:
    """Held-out prompts as data.split holds out examples (the same share, the same seeded draw)."""
    order = np.random.default_rng(seed).permutation(len(prompts))
    n_eval = max(1, int(len(prompts) * eval_fraction)) if eval_fraction else 0
    return prompts.subset(np.sort(order[n_eval:])), prompts.subset(np.sort(order[:n_eval]))


def prompt_batches(prompts: Prompts, batch_size: int, seed: int) -> list[Prompts]:
    """An epoch's batches of batch_size prompts, in a seeded order."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts.subset(order[s : s + batch_size]) for s in range(0, len(order), batch_size)]


def job_prompts(spec: TrainerSpec, tokenizer: PreTrainedTokenizerBase) -> tuple[Prompts, Prompts]:
    """A grpo job's prompts: those it trains on, and at most train.eval_samples held out (its validation_dataset,
    or its eval_fraction of the dataset)."""
    t = spec.request.train
    if spec.dataset is None:
        raise JobError(
            "grpo trains on an rft dataset the agent fetched: name one in dataset, and run the trainer through a "
            "jetlora agent"
        )
    room = t.max_seq_length - t.max_completion_tokens
    prompts = read_prompts(spec.dataset.path, tokenizer, room, t.grader)
    if spec.validation is not None:
        train_set, held_out = prompts, read_prompts(spec.validation.path, tokenizer, room, t.grader)
    else:
        train_set, held_out = split(prompts, t.eval_fraction, t.seed)
    return train_set, held_out.subset(range(min(len(held_out), t.eval_samples)))
