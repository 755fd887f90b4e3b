"""Each dataset format's rows as text and the character spans the loss covers, then token ids and targets.

A row is rendered as the model will see it (its chat template where it has one) and tokenized once, with
offsets; a token is learnt when it starts inside a learnt span. That is exact for any template: the span of an
assistant turn is found by rendering the conversation up to it, so whatever text a template puts around turns
stays out of the loss, and the turn's own end-of-turn marker is in it.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.datasets import AlpacaRow, ChatRow, QARow, TextRow
from trainer.errors import JobError

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


def prompt_text(tokenizer, question: str) -> str:
    """The model's chat template when it has one, else a plain question/answer template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    return (tokenizer.bos_token or "") + PLAIN_TEMPLATE.format(q=question)


def _completion(tokenizer, prompt: str, answer: str, completions_only: bool) -> Rendered:
    text = prompt_text(tokenizer, prompt) + answer + tokenizer.eos_token
    return Rendered(text, [(len(text) - len(answer) - len(tokenizer.eos_token) if completions_only else 0, len(text))])


def alpaca_prompt(row: AlpacaRow) -> str:
    return f"{row.instruction}\n\n{row.input}" if row.input.strip() else row.instruction


def render_chat(tokenizer, row: ChatRow, completions_only: bool) -> Rendered:
    if not getattr(tokenizer, "chat_template", None):
        raise JobError("chat data needs the model's chat template, and this tokenizer has none: add chat_template to "
                       "the model's tokenizer_config.json, or upload the data as qa or text")
    messages = [{"role": m.role, "content": m.content} for m in row.messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if not completions_only:
        return Rendered(text, [(0, len(text))])
    spans = []
    for i, m in enumerate(row.messages):
        if m.role != "assistant" or m.weight == 0:
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False).rstrip()
        if not (text.startswith(before) and text.startswith(through) and len(through) > len(before)):
            raise JobError("this model's chat template renders a conversation's earlier turns differently once later "
                           "turns follow (as templates that drop past reasoning do), so the assistant turns cannot be "
                           "found exactly; train with train.completions_only false, or use a model whose template "
                           "keeps earlier turns as they were")
        spans.append((len(before), len(through)))
    return Rendered(text, spans)


def render(fmt: str, row, tokenizer, completions_only: bool) -> Rendered:
    if fmt == "qa":
        return _completion(tokenizer, row.q, row.a, completions_only)
    if fmt == "alpaca":
        return _completion(tokenizer, alpaca_prompt(row), row.output, completions_only)
    if fmt == "chat":
        return render_chat(tokenizer, row, completions_only)
    bos = tokenizer.bos_token or ""
    text = bos + row.text + tokenizer.eos_token
    return Rendered(text, [(len(bos), len(text))], windows=True)


ROW_OF = {"qa": QARow, "alpaca": AlpacaRow, "chat": ChatRow, "text": TextRow}


def examples_of(rendered: list[Rendered], tokenizer, max_len: int) -> list[list[Example]]:
    """Tokenize a block of rendered rows at once; each row gives its examples (none when nothing learnt fits)."""
    enc = tokenizer([r.text for r in rendered], add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for r, ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
        learn = [any(s <= start < e for s, e in r.spans) for start, _ in offsets]
        if r.windows:
            cuts = [(i, min(i + max_len, len(ids))) for i in range(0, len(ids), max_len)]
        else:
            cuts = [(0, min(max_len, len(ids)))]
        row = []
        for a, b in cuts:
            targets = [ids[t + 1] if learn[t + 1] else IGNORE for t in range(a, b - 1)] + [IGNORE]
            if any(t != IGNORE for t in targets):
                row.append(Example(ids=list(ids[a:b]), targets=targets))
        out.append(row)
    return out


def prompt_tokens(tokenizer, rendered: Rendered) -> int:
    """Tokens before the first learnt one: what an over-long prompt error reports."""
    return len(tokenizer(rendered.text[:rendered.spans[0][0]], add_special_tokens=False)["input_ids"])
