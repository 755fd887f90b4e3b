"""Each dataset format's rows as text and the character spans the loss covers, then token ids and targets.

A row is rendered as the model will see it (its chat template where it has one) and tokenized once, with
offsets; a token is learnt when it starts inside a learnt span. That is exact for any template: the span of an
assistant turn is found by rendering the conversation up to it, so whatever text a template puts around turns
stays out of the loss, and the turn's own end-of-turn marker is in it. Where a template writes each turn as header,
content and end marker, the spans are found in the one render instead (chat_spans), with the same result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from schemas.datasets import AlpacaRow, ChatMessage, ChatRow, PreferenceRow, QARow, TextRow
from trainer.data.chat_render import render_messages, template_text
from trainer.data.chat_spans import TurnMarks, assistant_spans, turn_marks
from trainer.errors import JobError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE = -100
PLAIN_TEMPLATE = "### Question:\n{q}\n\n### Answer:\n"


@dataclass
class Example:
    ids: list[int]
    targets: list[int]  # already shifted: targets[t] is the token to predict after ids[t]; IGNORE where none


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # [start, end) character ranges the loss covers
    windows: bool = False  # text: cut into max-length windows rather than truncated


def prompt_text(tokenizer: PreTrainedTokenizerBase, question: str) -> str:
    """The model's chat template when it has one, else a plain question/answer template."""
    if getattr(tokenizer, "chat_template", None):
        return template_text(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True)
    return (tokenizer.bos_token or "") + PLAIN_TEMPLATE.format(q=question)


def _completion(tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str, completions_only: bool) -> Rendered:
    text = prompt_text(tokenizer, prompt) + answer + tokenizer.eos_token
    return Rendered(text, [(len(text) - len(answer) - len(tokenizer.eos_token) if completions_only else 0, len(text))])


def alpaca_prompt(row: AlpacaRow) -> str:
    return f"{row.instruction}\n\n{row.input}" if row.input.strip() else row.instruction


def render_chat(
    tokenizer: PreTrainedTokenizerBase, row: ChatRow, completions_only: bool, fast: bool = True
) -> Rendered:
    """The conversation as the model sees it; with completions_only, the assistant turns are the spans, found in
    the one render where the template allows (chat_spans), else by rendering up to each turn (fast=False)."""
    if not getattr(tokenizer, "chat_template", None):
        raise JobError(
            "chat data needs the model's chat template, and this tokenizer has none: add chat_template to "
            "the model's tokenizer_config.json, or upload the data as qa or text"
        )
    messages = [{"role": m.role, "content": m.content} for m in row.messages]
    text = render_messages(tokenizer, messages, fast)
    if not completions_only:
        return Rendered(text, [(0, len(text))])
    marks = _marks_of(tokenizer) if fast else None
    found = assistant_spans(text, row.messages, marks) if marks else None
    return Rendered(text, found if found is not None else _exact_spans(tokenizer, row, messages, text))


_MARKS: dict[int, tuple[object, TurnMarks | None]] = {}


def _marks_of(tokenizer: PreTrainedTokenizerBase) -> TurnMarks | None:
    known = _MARKS.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        known = _MARKS[id(tokenizer)] = (tokenizer, turn_marks(tokenizer))
    return known[1]


def _exact_spans(
    tokenizer: PreTrainedTokenizerBase, row: ChatRow, messages: list[dict], text: str
) -> list[tuple[int, int]]:
    spans = []
    for i, m in enumerate(row.messages):
        if m.role != "assistant" or m.weight == 0:
            continue
        before = template_text(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = template_text(tokenizer, messages[: i + 1]).rstrip()
        if not (text.startswith(before) and text.startswith(through) and len(through) > len(before)):
            raise JobError(
                "this model's chat template renders a conversation's earlier turns differently once later "
                "turns follow (as templates that drop past reasoning do), so the assistant turns cannot be "
                "found exactly; train with train.completions_only false, or use a model whose template "
                "keeps earlier turns as they were"
            )
        spans.append((len(before), len(through)))
    return spans


def render_pair(tokenizer: PreTrainedTokenizerBase, row: PreferenceRow, fast: bool = True) -> tuple[Rendered, Rendered]:
    """A preference row as two conversations, the chosen answer's and the rejected one's; each learns only its
    answer (the input's own assistant turns are context)."""
    context = [
        ChatMessage(m.role, m.content, weight=0 if m.role == "assistant" else None, name=m.name)
        for m in row.input.messages
    ]
    chosen, rejected = (
        ChatRow(messages=context + [ChatMessage("assistant", side[0].content)])
        for side in (row.preferred_output, row.non_preferred_output)
    )
    return render_chat(tokenizer, chosen, True, fast), render_chat(tokenizer, rejected, True, fast)


def render(fmt: str, row, tokenizer: PreTrainedTokenizerBase, completions_only: bool, fast: bool = True) -> Rendered:
    if fmt == "qa":
        return _completion(tokenizer, row.q, row.a, completions_only)
    if fmt == "alpaca":
        return _completion(tokenizer, alpaca_prompt(row), row.output, completions_only)
    if fmt == "chat":
        return render_chat(tokenizer, row, completions_only, fast)
    bos = tokenizer.bos_token or ""
    text = bos + row.text + tokenizer.eos_token
    return Rendered(text, [(len(bos), len(text))], windows=True)


ROW_OF = {"qa": QARow, "alpaca": AlpacaRow, "chat": ChatRow, "text": TextRow, "preference": PreferenceRow}


def token_rows(
    rendered: list[Rendered], tokenizer: PreTrainedTokenizerBase, max_len: int
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Tokenize a block of rendered rows at once; each row gives its examples as (ids, learnt) arrays, learnt[t]
    saying whether the token after ids[t] is learnt (none when nothing learnt fits)."""
    enc = tokenizer([r.text for r in rendered], add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for r, ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
        ids = np.asarray(ids, np.int64)
        starts = np.fromiter((s for s, _ in offsets), np.int64, len(offsets))
        learn = np.zeros(len(ids), bool)
        for s, e in r.spans:
            learn |= (starts >= s) & (starts < e)
        if r.windows:
            cuts = [(i, min(i + max_len, len(ids))) for i in range(0, len(ids), max_len)]
        else:
            cuts = [(0, min(max_len, len(ids)))]
        row = []
        for a, b in cuts:
            learnt = np.zeros(b - a, np.uint8)
            learnt[:-1] = learn[a + 1 : b]
            if learnt.any():
                row.append((ids[a:b], learnt))
        out.append(row)
    return out


def examples_of(rendered: list[Rendered], tokenizer: PreTrainedTokenizerBase, max_len: int) -> list[list[Example]]:
    """token_rows as lists: targets[t] is ids[t + 1] where learnt, else IGNORE."""

    def example(ids: np.ndarray, learnt: np.ndarray) -> Example:
        following = np.append(ids[1:], IGNORE)
        return Example(ids=ids.tolist(), targets=np.where(learnt.astype(bool), following, IGNORE).tolist())

    return [[example(ids, learnt) for ids, learnt in row] for row in token_rows(rendered, tokenizer, max_len)]


def prompt_tokens(tokenizer: PreTrainedTokenizerBase, rendered: Rendered) -> int:
    """Tokens before the first learnt one: what an over-long prompt error reports."""
    return len(tokenizer(rendered.text[: rendered.spans[0][0]], add_special_tokens=False)["input_ids"])
