"""Tokenizing a dataset fast gives what the exact way gives: assistant turns found in one render have the spans
that rendering up to each turn finds, a template that rewrites earlier turns is still refused, and blocks done in
worker processes make the same token cache as one process."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from schemas.datasets import ChatMessage, ChatRow
from tests.qa import QA_PAIRS
from tests.test_dataset_formats import CONVERSATION, MARKERS, TEMPLATES, data_file
from trainer.data import blocks
from trainer.data.chat_spans import turn_marks
from trainer.errors import JobError
from trainer.data.formats import render_chat
from trainer.data.tokenize import tokenized

REWRITES_EARLIER_TURNS = (  # as templates that drop past reasoning do
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

AWKWARD = [  # content a template trims, content repeated in the user's turn, an empty answer
    ChatRow(
        messages=[ChatMessage(role="user", content="Say Paris. "), ChatMessage(role="assistant", content="Paris. ")]
    ),
    ChatRow(
        messages=[
            ChatMessage(role="user", content="Paris"),
            ChatMessage(role="assistant", content="Paris"),
            ChatMessage(role="user", content="Paris"),
            ChatMessage(role="assistant", content=""),
        ]
    ),
    ChatRow(
        messages=[
            ChatMessage(role="system", content="<|im_start|>assistant\nParis<|im_end|>"),
            ChatMessage(role="user", content="Where?"),
            ChatMessage(role="assistant", content="Paris"),
        ]
    ),
]


@pytest.fixture(scope="module")
def tokenizers():
    from tests.conftest import tinymodel

    base = tinymodel().build_tokenizer([f"{q} {a}" for q, a in QA_PAIRS], 400)
    made = {"tiny": base}  # the tiny model's own template: no end-of-turn marker, a newline after each turn
    for name, (template, _) in {**TEMPLATES, "rewrites": (REWRITES_EARLIER_TURNS, "")}.items():
        tok = copy.deepcopy(base)
        tok.add_special_tokens({"additional_special_tokens": MARKERS})
        tok.chat_template = template
        made[name] = tok
    return made


@pytest.mark.parametrize("template", sorted(TEMPLATES) + ["tiny"])
def test_turns_found_in_one_render_have_the_exact_spans(tokenizers, template):
    tok = tokenizers[template]
    assert turn_marks(tok) is not None, "each template writes a header, the content, and what ends a turn"
    for row in [CONVERSATION, *AWKWARD]:
        try:
            exact = render_chat(tok, row, True, fast=False)
        except JobError:  # the tiny template's empty answer: nothing of it to learn, refused either way
            with pytest.raises(JobError):
                render_chat(tok, row, True, fast=True)
            continue
        fast = render_chat(tok, row, True, fast=True)
        assert fast.text == exact.text and fast.spans == exact.spans, row


def test_a_template_that_rewrites_earlier_turns_is_refused_as_before(tokenizers):
    tok = tokenizers["rewrites"]
    row = ChatRow(
        messages=[
            ChatMessage(role="user", content="Where?"),
            ChatMessage(role="assistant", content="<think>France</think>Paris"),
            ChatMessage(role="user", content="Again?"),
            ChatMessage(role="assistant", content="Paris"),
        ]
    )
    for fast in (True, False):
        with pytest.raises(JobError, match="renders a conversation's earlier turns differently"):
            render_chat(tok, row, True, fast=fast)


def test_blocks_in_worker_processes_make_the_same_cache_as_one_process(tokenizers, tmp_path, monkeypatch):
    tok = tokenizers["chatml"]
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{q} ({n})"},
                {"role": "assistant", "content": a},
                {"role": "user", "content": "Again?"},
                {"role": "assistant", "content": a, "weight": n % 2},
            ]
        }
        for n, (q, a) in enumerate(QA_PAIRS * 400)
    ]  # 6,400 rows: 13 blocks, enough for workers
    data = data_file(tmp_path / "chat.jsonl", "chat", rows)
    made = {}
    for workers in (1, 2):
        monkeypatch.setattr(blocks, "usable_cores", lambda: workers)  # noqa: B023 (used before the next pass)
        examples, meta = tokenized(data, tok, str(tmp_path), 256, True, tmp_path / f"cache-{workers}", lambda *a: None)
        made[workers] = (
            np.asarray(examples.ids),
            np.asarray(examples.targets.learnt),
            np.asarray(examples.offsets),
            json.dumps(meta),
        )
    assert meta["rows"] == len(rows) and meta["examples"] == len(rows)
    for one, two in zip(made[1], made[2]):
        assert np.array_equal(one, two) if isinstance(one, np.ndarray) else one == two
