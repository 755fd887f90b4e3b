"""Dataset formats in the trainer: the chat loss mask is exactly the assistant turns, for real template texts;
each format trains on the tiny model and its loss falls; a tokenized dataset is kept and reused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from schemas.datasets import ChatMessage, ChatRow
from schemas.events import DataFile, Preparing, Progress
from schemas.jobs import DatasetRef
from tests.conftest import spec_for, tinymodel
from trainer.data.formats import ROW_OF
from tests.qa import QA_PAIRS
from tests.test_trainer import events_from
from trainer.data.formats import IGNORE, examples_of, render_chat
from trainer.job.loop import train

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {"llama3": (LLAMA3, "<|eot_id|>"), "chatml": (CHATML, "<|im_end|>")}
MARKERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]

CONVERSATION = ChatRow(
    messages=[
        ChatMessage(role="system", content="You answer in one sentence."),
        ChatMessage(role="user", content=QA_PAIRS[0][0]),
        ChatMessage(role="assistant", content=QA_PAIRS[0][1]),
        ChatMessage(role="user", content=QA_PAIRS[1][0]),
        ChatMessage(role="assistant", content="I do not know.", weight=0),  # context only: not learnt
        ChatMessage(role="user", content=QA_PAIRS[2][0]),
        ChatMessage(role="assistant", content=QA_PAIRS[2][1]),
    ]
)


@pytest.fixture(scope="module")
def base_tokenizer():
    return tinymodel().build_tokenizer([f"{q} {a}" for q, a in QA_PAIRS], 400)


def learnt_runs(ids: list[int], targets: list[int]) -> list[list[int]]:
    """The learnt tokens (those some position predicts), in contiguous runs."""
    learnt = [False] + [t != IGNORE for t in targets[:-1]]
    runs, run = [], []
    for tok, is_learnt in zip(ids, learnt):
        if is_learnt:
            run.append(tok)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_the_chat_mask_covers_exactly_the_assistant_turns(base_tokenizer, template):
    import copy

    text, end_of_turn = TEMPLATES[template]
    tok = copy.deepcopy(base_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = text
    rendered = render_chat(tok, CONVERSATION, completions_only=True)
    [[example]] = examples_of([rendered], tok, 4096)
    runs = learnt_runs(example.ids, example.targets)
    expected = [m.content + end_of_turn for m in CONVERSATION.messages if m.role == "assistant" and m.weight != 0]
    # token by token: every learnt token lies in an expected run, every expected run is learnt whole, nothing else
    assert [tok.decode(run) for run in runs] == expected
    assert example.ids == tok(rendered.text, add_special_tokens=False)["input_ids"]
    assert sum(map(len, runs)) == sum(len(tok(e, add_special_tokens=False)["input_ids"]) for e in expected)
    # the template's own text around the turns (headers, the default system prompt) is never learnt
    learnt_text = "".join(tok.decode(r) for r in runs)
    assert "assistant" not in learnt_text and "helpful" not in learnt_text and "I do not know" not in learnt_text

    [[everything]] = examples_of([render_chat(tok, CONVERSATION, completions_only=False)], tok, 4096)
    assert all(t != IGNORE for t in everything.targets[:-1])


def rows_of(fmt: str) -> list[dict]:
    if fmt == "qa":
        return [{"q": q, "a": a} for q, a in QA_PAIRS]
    if fmt == "alpaca":
        return [{"instruction": "Answer the question.", "input": q, "output": a} for q, a in QA_PAIRS]
    if fmt == "text":
        return [{"text": f"{q} {a}"} for q, a in QA_PAIRS]
    return [
        {
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
            ]
        }
        for q, a in QA_PAIRS
    ]


def data_file(path: Path, fmt: str, rows: list[dict]) -> DataFile:
    """Rows written as a JSON-lines dataset, described as the agent describes a fetched one."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataFile(path=str(path), sha256=hashlib.sha256(path.read_bytes()).hexdigest(), format=fmt, rows=len(rows))


def dataset_file(tmp_path: Path, fmt: str) -> DataFile:
    return data_file(tmp_path / f"{fmt}.jsonl", fmt, rows_of(fmt))


def dataset_spec(tiny_model, tmp_path, fmt: str, **train):
    spec = spec_for(tiny_model, tmp_path, **train)
    data = dataset_file(tmp_path, fmt)
    request = msgspec.structs.replace(spec.request, data=[], dataset=DatasetRef(name=fmt, sha256=data.sha256))
    return msgspec.structs.replace(spec, request=request, dataset=data, token_cache=str(tmp_path / "tokens"))


@pytest.mark.parametrize("fmt", ["qa", "chat", "alpaca", "text"])
def test_each_format_trains_and_the_loss_falls(tiny_model, tmp_path, capsys, fmt):
    finished = train(dataset_spec(tiny_model, tmp_path, fmt, max_steps=30))
    events = events_from(capsys.readouterr().out)
    progress = [e for e in events if isinstance(e, Progress)]
    preparing = [e for e in events if isinstance(e, Preparing)]
    assert finished.state == "trained" and len(progress) == 30
    assert progress[-1].loss < 0.5 * progress[0].loss, (fmt, progress[0].loss, progress[-1].loss)
    assert preparing and preparing[-1].done == len(QA_PAIRS) and "tokenized" in preparing[-1].message
    assert len(list((tmp_path / "tokens").glob("*-*"))) == 1


def test_a_tokenized_dataset_is_reused_and_gives_the_same_run(tiny_model, tmp_path, capsys):
    first = dataset_spec(tiny_model, tmp_path, "chat", max_steps=5)
    train(first)
    events = events_from(capsys.readouterr().out)
    again = msgspec.structs.replace(first, out_dir=str(tmp_path / "out2"))
    train(again)
    events_again = events_from(capsys.readouterr().out)
    assert any(isinstance(e, Preparing) for e in events)
    assert not any(isinstance(e, Preparing) for e in events_again)  # from the cache: nothing to tokenize
    losses = [e.loss for e in events if isinstance(e, Progress)]
    assert losses == [e.loss for e in events_again if isinstance(e, Progress)]


def test_a_held_out_dataset_is_evaluated(tiny_model, tmp_path, capsys):
    spec = dataset_spec(tiny_model, tmp_path, "qa", max_steps=10, eval_steps=5)
    held_out = tmp_path / "held"
    held_out.mkdir()
    validation = dataset_file(held_out, "alpaca")
    spec = msgspec.structs.replace(
        spec,
        validation=validation,
        request=msgspec.structs.replace(
            spec.request, validation_dataset=DatasetRef(name="held", sha256=validation.sha256)
        ),
    )
    train(spec)
    evals = [e.eval_loss for e in events_from(capsys.readouterr().out) if isinstance(e, Progress) and e.eval_loss]
    assert len(evals) >= 2 and evals[-1] < evals[0]


def test_a_file_with_a_byte_order_mark_and_crlf_lines_tokenizes_as_the_plain_one(tiny_model, tmp_path):
    """Excel and Windows tools write a UTF-8 BOM and CRLF line ends: the same examples as the plain file."""
    from trainer.model import load
    from trainer.data.tokenize import tokenized

    tok, _ = load(str(tiny_model), "cpu", torch.float32)
    plain = dataset_file(tmp_path, "chat")
    windows = tmp_path / "windows.jsonl"
    windows.write_bytes(b"\xef\xbb\xbf" + Path(plain.path).read_bytes().replace(b"\n", b"\r\n"))
    spotted = msgspec.structs.replace(plain, path=str(windows), sha256=hashlib.sha256(windows.read_bytes()).hexdigest())
    a, _ = tokenized(plain, tok, str(tiny_model), 128, True, tmp_path / "tokens", lambda *_: None)
    b, _ = tokenized(spotted, tok, str(tiny_model), 128, True, tmp_path / "tokens", lambda *_: None)
    assert len(a) == len(b) == len(QA_PAIRS)
    assert all((a[i][0] == b[i][0]).all() and (a[i][1] == b[i][1]).all() for i in range(len(a)))


@pytest.mark.parametrize("fmt", ["chat", "text"])
def test_the_token_cache_stores_three_bytes_a_token_and_gives_back_the_examples(tiny_model, tmp_path, fmt):
    """ids in the narrowest type the vocabulary allows (uint16 here), targets as a one-byte mask over the next token:
    what comes back is what the formats made, example for example."""
    from trainer.data.examples import IGNORE, examples_of, render
    from trainer.model import load
    from trainer.data.tokenize import cache_key, tokenized

    tok, _ = load(str(tiny_model), "cpu", torch.float32)
    data = dataset_file(tmp_path, fmt)
    rows = [msgspec.json.decode(line, type=ROW_OF[fmt]) for line in Path(data.path).read_bytes().splitlines()]
    made = [ex for row in examples_of([render(fmt, r, tok, True) for r in rows], tok, 48) for ex in row]
    back, meta = tokenized(data, tok, str(tiny_model), 48, True, tmp_path / "tokens", lambda *_: None)
    assert len(back) == len(made) > len(rows) - 1 and meta["ids_dtype"] == "uint16"
    for i, ex in enumerate(made):
        ids, targets = back[i]
        assert ids.tolist() == list(ex.ids) and targets.tolist() == list(ex.targets), i
        assert targets.dtype == np.int32 and (targets != IGNORE).any()
    stored = tmp_path / "tokens" / cache_key(data, tok, str(tiny_model), 48, True)
    per_token = ((stored / "ids.bin").stat().st_size + (stored / "learnt.bin").stat().st_size) / meta["tokens"]
    assert per_token == 3, per_token  # was 8: two int32 arrays
