"""The trainer for real, on CPU, on a tiny Llama built locally: it learns, masks, packs, stops, refuses bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import torch

from schemas.events import Failed, Finished, Progress, TrainerEvent, TrainerSpec
from tests.conftest import ROOT, spec_for
from tests.qa import pairs
from trainer.data import examples as data
from trainer.__main__ import main as trainer_main
from trainer.job.loop import evaluate, train
from trainer.model import load


def events_from(text: str) -> list:
    dec = msgspec.json.Decoder(TrainerEvent)
    return [dec.decode(line) for line in text.splitlines() if line.startswith("{")]


def test_the_loss_falls_clearly(tiny_model, tmp_path, capsys):
    import time

    t0 = time.monotonic()
    finished = train(spec_for(tiny_model, tmp_path, max_steps=50))
    wall = time.monotonic() - t0
    progress = [e for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)]
    assert finished.state == "trained" and finished.step == 50
    assert len(progress) == 50
    first, last = progress[0], progress[-1]
    assert last.loss < 0.5 * first.loss, (first.loss, last.loss)
    assert last.tokens > first.tokens > 0 and 0 < last.elapsed_s < wall
    assert abs(last.tokens_per_s - last.tokens / last.elapsed_s) < 1e-6 * last.tokens_per_s
    assert last.peak_mib > 0 and last.eta_s == 0 and last.lr is not None and last.grad_norm is not None
    assert (Path(finished.adapter_dir) / "adapter_model.safetensors").exists()

    # its fingerprint: what the saved adapter on a freshly loaded base answers, and the base alone does not
    from peft import PeftModel

    from schemas.job_status import PROBE_PROMPT
    from trainer.samples import probe

    assert finished.probe is not None and finished.probe.prompt == PROBE_PROMPT and finished.probe.dtype == "float32"
    assert finished.probe.text.startswith(finished.probe.head) and finished.probe.text
    tok, base = load(str(tiny_model), "cpu", torch.float32)
    served = PeftModel.from_pretrained(base, finished.adapter_dir)
    assert probe(served, tok, "cpu") == finished.probe
    with served.disable_adapter():
        assert probe(served, tok, "cpu").text != finished.probe.text


def test_completion_only_masks_the_question(tiny_model):
    tok, _ = load(str(tiny_model), "cpu", torch.float32)
    from schemas.jobs import QA

    pair = QA(q="What is the capital of France?", a="The capital of France is Paris.")
    [ex] = data.encode(tok, [pair], 128, completions_only=True)
    prompt_len = len(tok(data.prompt_text(tok, pair.q), add_special_tokens=False)["input_ids"])
    answer = tok(pair.a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # targets are shifted labels: position t predicts token t+1; the question's tokens are never predicted
    assert ex.targets[: prompt_len - 1] == [data.IGNORE] * (prompt_len - 1)
    assert ex.targets[prompt_len - 1 : prompt_len - 1 + len(answer)] == answer
    assert ex.targets[-1] == data.IGNORE
    [full] = data.encode(tok, [pair], 128, completions_only=False)
    assert sum(t != data.IGNORE for t in full.targets) == len(full.ids) - 1 > len(answer)


def test_packed_rows_never_attend_across_examples(tiny_model):
    """Examples packed into rows of at most max_seq_length, several rows a batch: each example is in exactly one
    row, no row is longer than max_seq_length, and the batch's loss is the loss of its examples one by one."""
    from schemas.jobs import QA
    from trainer.objectives.losses import batch_loss

    tok, model = load(str(tiny_model), "cpu", torch.float32)
    examples = data.encode(tok, [QA(**p) for p in pairs()] * 3, 128)
    packed = data.packed_batches(examples, 128, 3, seed=0)
    lengths = [len(e.ids) for e in examples]
    rows = [row for group in packed.groups for row in group]
    assert sorted(int(i) for row in rows for i in row) == list(range(len(examples)))
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows) and len(rows) < len(examples) / 3
    assert all(b.input_ids.shape[0] <= 3 and b.input_ids.shape[1] <= 128 for b in packed)
    assert sum(b.tokens for b in packed) == sum(lengths)  # padding only ends a row, and is not counted

    with torch.no_grad():
        together = sum(float(batch_loss(model, b, torch.float32)[0]) for b in packed)
        alone = sum(float(batch_loss(model, b, torch.float32)[0]) for b in data.padded_batches(examples, 1, 0, 0))
        padded = evaluate(
            model, data.padded_batches(examples, 4, seed=0, pad_id=tok.pad_token_id), "cpu", torch.float32
        )
    assert abs(together - alone) < 1e-5 * alone, (together, alone)
    assert abs(evaluate(model, packed, "cpu", torch.float32) - padded) < 1e-5 * padded


def test_stop_and_save_gives_a_loadable_adapter_that_changes_the_model(tiny_model, tmp_path):
    spec = spec_for(tiny_model, tmp_path, max_steps=100_000)
    path = tmp_path / "job.json"
    path.write_bytes(msgspec.json.encode(spec))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", str(path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    dec = msgspec.json.Decoder(TrainerEvent)
    seen = 0
    for line in proc.stdout:
        ev = dec.decode(line)
        if isinstance(ev, Progress):
            seen += 1
            if seen == 20:
                proc.send_signal(signal.SIGUSR1)
        if isinstance(ev, (Finished, Failed)):
            break
    assert proc.wait(60) == 0
    assert isinstance(ev, Finished) and ev.state == "stopped" and 20 <= ev.step < 100_000

    from peft import PeftModel

    tok, base = load(str(tiny_model), "cpu", torch.float32)
    ids = tok("What is the capital of France?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = base(ids).logits.clone()
        tuned = PeftModel.from_pretrained(base, ev.adapter_dir)
        after = tuned(ids).logits
    assert not torch.allclose(before, after, atol=1e-3)


def run_main(tmp_path, spec: dict | TrainerSpec, capsys) -> tuple[int, list]:
    path = tmp_path / "job.json"
    path.write_bytes(msgspec.json.encode(spec))
    rc = trainer_main(["trainer", str(path)])
    return rc, events_from(capsys.readouterr().out)


def bad(tmp_path, capsys, spec) -> str:
    rc, events = run_main(tmp_path, spec, capsys)
    assert rc == 1
    assert isinstance(events[-1], Failed)
    return events[-1].message


def test_a_missing_directory_fails_cleanly(tiny_model, tmp_path, capsys):
    spec = spec_for(tiny_model, tmp_path)
    spec.request.base_dir = str(tmp_path / "nowhere")
    assert "is not a directory on this node" in bad(tmp_path, capsys, spec)


def test_a_pickle_only_model_is_refused(tiny_model, tmp_path, capsys):
    d = tmp_path / "binmodel"
    d.mkdir()
    (d / "config.json").write_text((Path(tiny_model) / "config.json").read_text())
    (d / "pytorch_model.bin").write_bytes(b"not loaded, ever")
    spec = spec_for(tiny_model, tmp_path)
    spec.request.base_dir = str(d)
    msg = bad(tmp_path, capsys, spec)
    assert "no .safetensors weights" in msg and "pickled weights are never loaded" in msg


def test_empty_data_and_non_object_lines_fail_cleanly(tiny_model, tmp_path, capsys):
    raw = json.loads(msgspec.json.encode(spec_for(tiny_model, tmp_path)))
    raw["request"]["data"] = []
    assert "the job has no training data" in bad(tmp_path, capsys, raw)
    raw["request"]["data"] = ["just a string"]
    assert "data[0]" in bad(tmp_path, capsys, raw)


def test_a_question_longer_than_max_seq_length_names_the_fix(tiny_model, tmp_path, capsys):
    spec = spec_for(tiny_model, tmp_path, max_seq_length=8)
    msg = bad(tmp_path, capsys, spec)
    assert "data[0]" in msg and "raise train.max_seq_length" in msg


def test_an_unknown_target_module_names_what_the_model_has(tiny_model, tmp_path, capsys):
    spec = spec_for(tiny_model, tmp_path)
    spec.request.lora.target_modules = ["c_attn"]
    msg = bad(tmp_path, capsys, spec)
    assert "c_attn" in msg and "q_proj" in msg


def test_eval_split_reports_eval_loss(tiny_model, tmp_path, capsys):
    train(spec_for(tiny_model, tmp_path, max_steps=6, eval_fraction=0.25, eval_steps=3))
    progress = [e for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)]
    assert progress[2].eval_loss is not None and progress[-1].eval_loss is not None
    assert progress[0].eval_loss is None


def test_checkpoints_hold_adapter_and_optimizer_state(tiny_model, tmp_path, capsys):
    train(spec_for(tiny_model, tmp_path, max_steps=6, save_steps=2))
    ck = Path(tmp_path / "out" / "checkpoints" / "step-4")
    state = torch.load(ck / "trainer_state.pt", weights_only=True)
    assert state["step"] == 4 and state["optimizer"]["state"] and "last_epoch" in state["scheduler"]
    assert (ck / "adapter" / "adapter_model.safetensors").exists()


def test_a_run_resumed_from_a_checkpoint_continues_the_same_loss_curve(tiny_model, tmp_path, capsys):
    train(spec_for(tiny_model, tmp_path / "full", max_steps=12, save_steps=5, grad_accum=2))
    full = {e.step: e.loss for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)}
    spec = spec_for(tiny_model, tmp_path / "resumed", max_steps=12, save_steps=5, grad_accum=2)
    spec.resume_from = str(tmp_path / "full" / "out" / "checkpoints" / "step-5")
    train(spec)
    events = events_from(capsys.readouterr().out)
    assert "resumed from step 5" in events[0].message
    resumed = {e.step: e.loss for e in events if isinstance(e, Progress)}
    assert sorted(resumed) == list(range(6, 13))
    for step, loss in resumed.items():
        assert abs(loss - full[step]) < 1e-3 * full[step], (step, loss, full[step])


def test_a_pause_asked_before_the_first_step_ends_after_it_with_the_checkpoint_to_resume_from(
    tiny_model, tmp_path, monkeypatch, capsys, trainer_signals
):
    """The agent asks a trainer that has not started yet through its environment: the run takes one step, then
    ends paused with the checkpoint resume needs (not paused with no checkpoint, nor stopped)."""
    from trainer.signals import Signals

    monkeypatch.setenv("JETLORA_PAUSE", "1")
    finished = train(spec_for(tiny_model, tmp_path, max_steps=20), Signals())
    assert finished.state == "paused" and finished.step == 1, finished
    assert (Path(finished.adapter_dir) / "adapter_config.json").is_file(), finished.adapter_dir
    capsys.readouterr()
