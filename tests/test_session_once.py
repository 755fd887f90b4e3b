"""A training session's trainer runs each call once, even across a pause: the ids of the calls it applied travel
with its checkpoint (beside the gradients not yet stepped), so a call its gateway sends again after the next
attempt resumed (the node had answered, the gateway died before storing the outcome) is answered as it was: an
optim_step is not taken twice, a forward_backward's gradient is not added twice. A named sampler save stays out of
the checkpoint and the trainer's memory, and is read back when it is sampled. Alone and as a member of a session
group, on the real trainer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from schemas.sessions import Sample, SaveWeights, StepResult, stored_sampler
from tests.test_session_pause import FB, STEP, Alone, Member, spec
from trainer import events
from trainer.session.applied_calls import FILE

KINDS = pytest.mark.parametrize("kind", [Alone, Member], ids=["alone", "member"])


def paused_and_resumed(kind, tiny_model, tmp_path: Path, first):
    """The session `first` paused; the next attempt, resumed from the checkpoint the agent stored of it."""
    first.pause()
    bundle = tmp_path / "checkpoint"
    shutil.copytree(tmp_path / "first" / "session", bundle)
    return kind(spec(tiny_model, tmp_path / "second", resume_from=bundle)), bundle


@KINDS
def test_calls_sent_again_after_a_pause_are_answered_as_they_were_never_run_twice(kind, tiny_model, tmp_path):
    with events.muted():
        straight = kind(spec(tiny_model, tmp_path / "straight"))
        for n, call in enumerate((FB, STEP, FB)):
            straight.call(call, f"c{n}")
        expected_step = straight.call(STEP, "c3")
        expected = straight.weights()

        first = kind(spec(tiny_model, tmp_path / "first"))
        answers = [first.call(call, f"c{n}") for n, call in enumerate((FB, STEP, FB))]
        resumed, bundle = paused_and_resumed(kind, tiny_model, tmp_path, first)
        assert (bundle / "current" / FILE).is_file()
        assert resumed.call(STEP, "c1") == answers[1]  # run again, it would step on the third call's gradient
        assert resumed.call(FB, "c2") == answers[2]  # run again, the gradient the pause kept would be doubled
        last = resumed.call(STEP, "c3")
    assert isinstance(last, StepResult) and last.step == expected_step.step == 2, last
    assert last.grad_norm == pytest.approx(expected_step.grad_norm, rel=1e-5)
    after = resumed.weights()
    for name in expected:
        assert torch.allclose(after[name], expected[name], atol=1e-6), name


@KINDS
def test_a_save_state_stores_the_calls_it_holds_and_a_sample_is_not_remembered(kind, tiny_model, tmp_path):
    with events.muted():
        first = kind(spec(tiny_model, tmp_path / "first"))
        first.call(FB, "fb")
        first.call(Sample(prompt=[5, 6], max_tokens=2, temperature=0.0), "sample")
        saved = first.call(SaveWeights(name="s", kind="state"), "save")
        kept = (tmp_path / "first" / "session" / "current" / FILE).read_text()
    assert saved.step == 0 and '"fb"' in kept and '"save"' in kept and '"sample"' not in kept, kept


@KINDS
def test_a_named_sampler_save_stays_out_of_the_checkpoint_and_is_read_back_when_sampled(kind, tiny_model, tmp_path):
    sample = Sample(prompt=[5, 6, 7], max_tokens=4, temperature=0.0, weights="named", stored=True)
    with events.muted():
        first = kind(spec(tiny_model, tmp_path / "first"))
        first.call(FB, "c0")
        first.call(STEP, "c1")
        first.call(SaveWeights(name="named", kind="sampler", stored=True), "c2")
        where = Path(stored_sampler(str(tmp_path / "first"), "named"))
        assert (where / "adapter_model.safetensors").is_file()
        before = first.call(sample)
        first.call(FB, "c3")
        first.call(STEP, "c4")  # the adapter moves on; the save does not
        resumed, bundle = paused_and_resumed(kind, tiny_model, tmp_path, first)
        assert not [p for p in bundle.rglob("*") if "named" in p.name], "the checkpoint carries the named save"
        refused = resumed.call(sample)
        shutil.copytree(where, stored_sampler(str(tmp_path / "second"), "named"))  # as the agent fetches it back
        after = resumed.call(sample)
    assert getattr(refused, "field", "") == "model_path", refused
    assert after.sequences[0].tokens == before.sequences[0].tokens
    assert after.sequences[0].logprobs == pytest.approx(before.sequences[0].logprobs, abs=1e-5)
