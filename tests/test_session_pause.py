"""A training session paused between a forward_backward and its optim_step (an idle pause, a silent client, a
preemption) goes on exactly as if it had not been: the gradients not yet stepped are kept with its checkpoint and
the optim_step after the resume takes them. Alone and as a member of a session group, on the real trainer."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from schemas.events import TrainerSpec
from schemas.jobs import JobRequest
from schemas.sessions import Datum, ForwardBackward, MemberCall, OptimStep
from trainer import events

FB = ForwardBackward(
    data=[Datum(tokens=[5, 6, 7, 8, 9], inputs={"target_tokens": [6, 7, 8, 9, 10]}),
          Datum(tokens=[11, 12, 13], inputs={"target_tokens": [12, 13, 14]})],
    loss_fn="cross_entropy",
)  # fmt: skip
STEP = OptimStep(learning_rate=5e-2)


def spec(model_dir: Path, out: Path, resume_from: Path | None = None) -> TrainerSpec:
    request = msgspec.convert(
        {"model": "tiny", "base_dir": str(model_dir), "train": {"method": "session"}, "accelerator": "cpu",
         "session": {"rank": 4, "seed": 3, "train_unembed": False}},
        JobRequest,
    )  # fmt: skip
    resumed = str(resume_from) if resume_from else None
    return TrainerSpec(
        job="s1", attempt=2 if resume_from else 1, request=request, out_dir=str(out), resume_from=resumed
    )


class Alone:
    """A session in a trainer of its own (trainer/session/serve.py)."""

    def __init__(self, s: TrainerSpec) -> None:
        from trainer.session.serve import Session

        self.session = Session(s)

    def call(self, call, call_id: str = ""):
        return self.session.take(call, call_id)

    def pause(self) -> None:
        self.session.end(pause=True)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.session.adapter_weights().items()}


class Member:
    """A session as a member of a session group (trainer/session/group.py), its calls through the group's rounds."""

    def __init__(self, s: TrainerSpec) -> None:
        from trainer.session.group import SessionGroup

        self.group, self.attempt, self.n = SessionGroup(), s.attempt, 0
        self.group.add(s)
        self.answers: list = []
        self.group.answer = lambda line, reply: self.answers.append(reply)  # type: ignore[method-assign]

    def call(self, call, call_id: str = ""):
        self.n += 1
        self.group.take(MemberCall(job="s1", attempt=self.attempt, id=self.n, call=call, call_id=call_id))
        while self.group.round():
            pass
        return self.answers[-1]

    def pause(self) -> None:
        self.group.end("s1", pause=True)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.group.members["s1"].adapter_weights().items()}


@pytest.mark.parametrize("kind", [Alone, Member], ids=["alone", "member"])
def test_a_pause_between_forward_backward_and_its_step_loses_no_gradient(kind, tiny_model, tmp_path):
    with events.muted():  # the trainer's event lines are not this test's (and other tests read them from stdout)
        check_no_gradient_lost(kind, tiny_model, tmp_path)


def check_no_gradient_lost(kind, tiny_model, tmp_path) -> None:
    straight = kind(spec(tiny_model, tmp_path / "straight"))
    straight.call(FB)
    straight.call(STEP)
    expected = straight.weights()

    paused = kind(spec(tiny_model, tmp_path / "first"))
    before = paused.weights()
    paused.call(FB)
    paused.pause()
    bundle = tmp_path / "checkpoint"  # what the agent stores and the next attempt fetches
    shutil.copytree(tmp_path / "first" / "session", bundle)
    resumed = kind(spec(tiny_model, tmp_path / "second", resume_from=bundle))
    reply = resumed.call(STEP)
    assert reply.step == 1, reply
    after = resumed.weights()
    assert after.keys() == expected.keys()
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    assert moved, "the step after the resume took no gradient"
    for name in after:
        assert torch.allclose(after[name], expected[name], atol=1e-6), name
