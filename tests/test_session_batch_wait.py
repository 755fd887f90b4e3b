"""A session group's forward_backward waits a moment for the members due to send theirs (#64): sessions stepped
together send their forward_backwards a moment apart, and each that came alone ran in a pass of its own. A member is
due when it stepped (its last call was not a forward_backward), has nothing waiting, and its forward_backwards
lately came within the wait of the answer before them, which was less than the wait ago; once every due member's
forward_backward is in, they run in one pass. On the real trainer; the wait is a minute here, so that a slow
machine does not make a member late."""

from __future__ import annotations

from pathlib import Path

import msgspec

from schemas.sessions import ForwardResult, MemberAnswer, MemberCall
from tests.test_session_pause import FB, STEP, spec
from trainer.session.group import SessionGroup

WAIT_S = 60.0

_answer = msgspec.json.Decoder(MemberAnswer)


def answers(capfdbinary) -> list[MemberAnswer]:
    """The answers the group printed (its events, GroupEvent lines, left)."""
    lines = capfdbinary.readouterr().out.splitlines()
    return [_answer.decode(raw) for raw in lines if raw.startswith(b"{") and b'"event"' not in raw]


def stepped_group(tiny_model: Path, tmp_path: Path, jobs: tuple[str, ...]) -> SessionGroup:
    """A group whose members each ran two steps (forward_backward, optim_step), their calls in together."""
    group = SessionGroup(wait_s=WAIT_S)
    for job in jobs:
        group.add(msgspec.structs.replace(spec(tiny_model, tmp_path / job), job=job))
    for n, call in enumerate((FB, STEP, FB, STEP), start=1):
        for job in jobs:
            group.take(MemberCall(job=job, attempt=1, id=n, call=call, call_id=f"{job}-{n}"))
        while group.round():
            pass
    return group


def test_a_forward_backward_waits_for_the_member_due_then_both_run_in_one_round(tiny_model, tmp_path, capfdbinary):
    group = stepped_group(tiny_model, tmp_path, ("s1", "s2"))
    group.take(MemberCall(job="s1", attempt=1, id=5, call=FB, call_id="s1-5"))
    assert group.short(), "s2 stepped just now: s1's forward_backward waits for its next one"
    group.take(MemberCall(job="s2", attempt=1, id=5, call=FB, call_id="s2-5"))
    assert not group.short(), "every member due sent its forward_backward: nothing to wait for"
    capfdbinary.readouterr()
    assert group.round()
    got = answers(capfdbinary)
    assert sorted((x.job, x.id) for x in got) == [("s1", 5), ("s2", 5)], got
    assert all(isinstance(x.reply, ForwardResult) for x in got), got
    assert not any(group.waiting.values())


def test_no_wait_for_a_member_late_slow_or_whose_step_is_next(tiny_model, tmp_path):
    group = stepped_group(tiny_model, tmp_path, ("s1", "s2"))
    group.take(MemberCall(job="s1", attempt=1, id=5, call=FB, call_id="s1-5"))
    assert group.short()
    group.last["s2"] -= WAIT_S  # its step was answered longer ago than the wait: it is late, not due
    assert not group.short()
    group.last["s2"] += WAIT_S
    group.back["s2"] = WAIT_S  # its forward_backwards come further apart than the wait
    assert not group.short()
    group.back["s2"] = 0.0
    group.kind["s2"] = type(FB)  # its forward_backward ran last: its optim_step comes next, not another
    assert not group.short()


def test_a_member_alone_or_a_group_in_turn_never_waits(tiny_model, tmp_path):
    alone = stepped_group(tiny_model, tmp_path / "alone", ("s1",))
    alone.take(MemberCall(job="s1", attempt=1, id=5, call=FB, call_id="s1-5"))
    assert not alone.short()
    in_turn = stepped_group(tiny_model, tmp_path / "turns", ("s1", "s2"))
    in_turn.batch = False  # JETLORA_SESSION_BATCH=off: every call in its own pass anyway
    in_turn.take(MemberCall(job="s1", attempt=1, id=5, call=FB, call_id="s1-5"))
    assert not in_turn.short()
