"""What a run tells and keeps (the real trainer, on CPU): early stopping on a rising eval loss with the best step's
adapter kept, samples by the base model and the adapter, and a TensorBoard log that reads back."""

from __future__ import annotations

import msgspec
import torch

from schemas.events import DataFile, Progress, Samples
from schemas.jobs import DatasetRef
from tests.conftest import spec_for
from tests.test_dataset_formats import data_file
from tests.qa import QA_PAIRS
from tests.test_trainer import events_from
from trainer.data import examples as data
from trainer.job.loop import evaluate, train
from trainer.model import load
from trainer.data.tokenize import tokenized

PROMPT = "What is the capital of France?"


def misleading_validation(tmp_path) -> DataFile:
    """The training questions with each answer moved to the next question: the better the adapter learns the
    training set, the worse it does here, so its eval loss falls at first and then rises."""
    answers = [a for _, a in QA_PAIRS]
    return data_file(
        tmp_path / "misleading.jsonl",
        "qa",
        [{"q": q, "a": answers[(i + 1) % len(answers)]} for i, (q, _) in enumerate(QA_PAIRS)],
    )


def test_early_stopping_ends_on_a_rising_eval_loss_and_keeps_the_best_steps_adapter(tiny_model, tmp_path, capsys):
    validation = misleading_validation(tmp_path)
    spec = spec_for(tiny_model, tmp_path, max_steps=200, eval_steps=2, early_stopping_patience=3, learning_rate=0.01)
    spec = msgspec.structs.replace(
        spec,
        validation=validation,
        token_cache=str(tmp_path / "tokens"),
        request=msgspec.structs.replace(
            spec.request, validation_dataset=DatasetRef(name="misleading", sha256=validation.sha256)
        ),
    )
    finished = train(spec)
    evals = {
        e.step: e.eval_loss for e in events_from(capsys.readouterr().out) if isinstance(e, Progress) and e.eval_loss
    }
    best_step = min(evals, key=evals.get)
    assert finished.state == "trained" and finished.step < 200, finished
    assert finished.step == best_step + 3 * 2  # three evaluations without improvement, two steps apart
    assert "stopped early" in finished.message and f"step {best_step}'s" in finished.message
    assert finished.best_step == best_step and abs(finished.best_eval_loss - evals[best_step]) < 1e-6
    assert max(evals.values()) > evals[best_step]  # it did rise

    # the adapter saved is the best step's: its eval loss, recomputed from the saved files, is the best one
    from peft import PeftModel

    tokenizer, model = load(str(tiny_model), "cpu", torch.float32)
    model = PeftModel.from_pretrained(model, finished.adapter_dir)
    examples, _ = tokenized(validation, tokenizer, str(tiny_model), 128, True, tmp_path / "tokens", lambda *a: None)
    batches = data.make_batches(examples, spec.request.train, tokenizer.pad_token_id, epoch=0)
    assert abs(evaluate(model, batches, "cpu", torch.float32) - evals[best_step]) < 1e-4


def test_samples_come_from_the_base_model_once_and_the_adapter_at_each_evaluation(tiny_model, tmp_path, capsys):
    spec = spec_for(
        tiny_model,
        tmp_path,
        max_steps=30,
        eval_steps=10,
        eval_fraction=0.25,
        sample_prompts=[PROMPT, "How many legs does a spider have?"],
        sample_max_tokens=12,
    )
    train(spec)
    samples = [e for e in events_from(capsys.readouterr().out) if isinstance(e, Samples)]
    assert [(s.model, s.step) for s in samples] == [("base", 0), ("adapter", 10), ("adapter", 20), ("adapter", 30)]
    assert [s.prompt for s in samples[0].samples] == [PROMPT, "How many legs does a spider have?"]
    base, trained = samples[0].samples[0].answer, samples[-1].samples[0].answer
    assert base != trained, (base, trained)


def test_auto_samples_take_the_held_out_prompts(tiny_model, tmp_path, capsys):
    train(spec_for(tiny_model, tmp_path, max_steps=4, eval_fraction=0.25, sample_prompts="auto", sample_max_tokens=4))
    base, *adapter = [e for e in events_from(capsys.readouterr().out) if isinstance(e, Samples)]
    questions = {q for q, _ in QA_PAIRS}
    assert len(base.samples) == 3 and all(any(q in s.prompt for q in questions) for s in base.samples)
    assert adapter and [s.prompt for s in adapter[-1].samples] == [s.prompt for s in base.samples]


def test_the_tensorboard_log_reads_back_with_every_step(tiny_model, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(
        spec_for(
            tiny_model,
            tmp_path,
            max_steps=12,
            eval_steps=4,
            eval_fraction=0.25,
            sample_prompts=[PROMPT],
            sample_max_tokens=4,
        )
    )
    progress = [e for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)]
    log = EventAccumulator(str(tmp_path / "out" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    log.Reload()
    losses = [(s.step, s.value) for s in log.Scalars("train/loss")]
    assert [step for step, _ in losses] == [p.step for p in progress]
    assert all(abs(value - p.loss) < 1e-5 for (_, value), p in zip(losses, progress))
    assert [s.step for s in log.Scalars("eval/loss")] == [4, 8, 12]
    assert "samples/adapter/text_summary" in log.Tags()["tensors"]
