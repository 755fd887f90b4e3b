"""An optim_step's answer is printed before its Progress (#64): the agent reads a trainer's stdout in order and
stores each Progress in JetStream before it reads the next line, so a Progress printed first held every step's
answer back by a JetStream round trip (and, in a session group, every member's answer behind it). The Progress is
still printed, right after: alone, and in a group once every answer of the round is out. On the real trainer."""

from __future__ import annotations

from pathlib import Path

import msgspec

from schemas.events import GroupEvent, Progress
from schemas.sessions import MemberAnswer, MemberCall, SessionAnswer, SessionLine, StepResult
from tests.test_session_pause import FB, STEP, spec

_answer = msgspec.json.Decoder(SessionAnswer | MemberAnswer | Progress)
_group = msgspec.json.Decoder(GroupEvent)


def printed(capfdbinary) -> list:
    """The trainer's lines, each as the agent decodes it."""
    out = []
    for raw in capfdbinary.readouterr().out.splitlines():
        if raw.startswith(b"{"):
            out.append(_group.decode(raw) if b'"event"' in raw else _answer.decode(raw))
    return out


def test_a_session_alone_prints_its_step_answer_before_its_progress(tiny_model, tmp_path: Path, capfdbinary):
    from trainer.session.serve import Session, answer

    session = Session(spec(tiny_model, tmp_path / "alone"))
    capfdbinary.readouterr()
    for n, call in enumerate((FB, STEP), start=1):
        answer(session, msgspec.json.encode(SessionLine(id=n, call=call, call_id=f"c{n}")))
    lines = printed(capfdbinary)
    kinds = [type(x).__name__ for x in lines]
    assert kinds == ["SessionAnswer", "SessionAnswer", "Progress"], kinds
    step, progress = lines[1], lines[2]
    assert isinstance(step.reply, StepResult) and step.reply.step == 1
    assert progress.step == 1 and progress.lr == STEP.learning_rate


def test_a_group_prints_every_answer_of_a_round_before_any_progress(tiny_model, tmp_path: Path, capfdbinary):
    from trainer.session.group import SessionGroup

    group = SessionGroup()
    specs = [msgspec.structs.replace(spec(tiny_model, tmp_path / job), job=job) for job in ("s1", "s2")]
    for s in specs:
        group.add(s)
    for n, call in enumerate((FB, STEP), start=1):
        for s in specs:
            group.take(MemberCall(job=s.job, attempt=s.attempt, id=n, call=call, call_id=f"{s.job}-{n}"))
    capfdbinary.readouterr()
    while group.round():
        pass
    lines = printed(capfdbinary)
    steps = [x for x in lines if isinstance(x, MemberAnswer) and isinstance(x.reply, StepResult)]
    progress = [x for x in lines if isinstance(x, GroupEvent) and isinstance(x.event, Progress)]
    assert sorted(x.job for x in steps) == ["s1", "s2"] and all(x.reply.step == 1 for x in steps), lines
    assert sorted(x.job for x in progress) == ["s1", "s2"] and all(x.event.step == 1 for x in progress), lines
    last_answer = max(i for i, x in enumerate(lines) if isinstance(x, MemberAnswer))
    first_progress = min(i for i, x in enumerate(lines) if isinstance(x, GroupEvent) and isinstance(x.event, Progress))
    assert last_answer < first_progress, [type(x).__name__ for x in lines]
