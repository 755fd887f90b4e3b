"""A session group's process: `python -m trainer.co_train` whose first job is a Tinker training session. Sessions of
one base (its content), precision and quantisation, of the tenants the operator's --co-train policy lets share,
hold the base once, each a member with its own LoRA, optimizer, random state, saves and sampler weights
(session_member.py); a base model's sampler is a member that samples with its adapter off.

The agent writes GroupControl lines (a session joins, is cancelled, stopped or paused) and MemberCall lines (a call
for one member) on stdin; each member's events go out as GroupEvent lines and its answers as MemberAnswer lines.
Members' calls interleave fairly: each round takes the oldest waiting call of every member, in turn, so one
member's long call holds up another's by one call at most; where several members' next calls are forward_backwards
that train, they run in one pass of the base (session_batch.py: on this 2-core CPU that pass cost about 40% of
running them one by one, bench/tinker_api.py; JETLORA_SESSION_BATCH=off runs every call in its own pass). A
forward_backward waits up to JETLORA_SESSION_BATCH_WAIT_MS (5) for the members due to send theirs within that time
(SessionGroup.short): several sessions stepped together send them a moment apart, and each came alone.

A member ends as a session alone does: stopped (its adapter saved), paused when asked or after idle_s with no call
(checkpointed: its next call resumes it wherever its job goes), cancelled (dropped at once). A member's failure is
its own: a call that fails or is refused is answered so, a loss that is not a number stays in its own gradients,
a joiner that cannot join fails alone. The process ends once its stdin is closed (every member left is paused
then, as a session alone whose input closes) and no member is left."""

from __future__ import annotations

import collections
import os
import time
import traceback

import msgspec

from schemas.events import Failed, Finished, GroupControl, GroupEvent, Requeue, Started, TrainerSpec
from schemas.sessions import CallError, ForwardBackward, MemberAnswer, MemberCall, SessionReply
from trainer.session import model as ops
from trainer.multi_lora.controls import Controls, addressed, note
from trainer.multi_lora.held_base import HeldBase, OtherWeights
from trainer.multi_lora.shared_base import SharedBase
from trainer.errors import JobError
from trainer.events import emit
from trainer.session.batch import batchable, forward_backward_together
from trainer.session.member import SessionMember

POLL_S = 0.2
BATCH_ENV = "JETLORA_SESSION_BATCH"  # "off": every call in its own pass
WAIT_ENV = "JETLORA_SESSION_BATCH_WAIT_MS"  # how long a forward_backward waits for the members due to join its pass
WAIT_MS = 5.0


class SessionGroup:
    def __init__(self, batch: bool = True, wait_s: float = WAIT_MS / 1000) -> None:
        self.held = HeldBase()
        self.base: SharedBase | None = None
        self.vocab = 0
        self.batch, self.wait_s = batch, wait_s
        self.members: dict[str, SessionMember] = {}
        self.waiting: dict[str, collections.deque[MemberCall]] = {}  # each member's calls not answered yet
        self.last: dict[str, float] = {}  # when each member was last called
        self.kind: dict[str, type] = {}  # the kind of each member's last call
        self.back: dict[str, float] = {}  # how soon each member's forward_backward came after its step's answer
        self.turns = 0  # which member goes first in the next round

    # --- joining and leaving --------------------------------------------------------------------------------------
    def handle(self, line: GroupControl | MemberCall) -> None:
        if isinstance(line, MemberCall):
            self.take(line)
            return
        if line.action == "add" and line.spec is not None:
            self.add(line.spec)
            return
        if addressed(self.members, line) is None:
            return
        if line.action == "cancel":
            self.drop(line.job)
        elif line.action in ("stop", "pause"):
            self.end(line.job, pause=line.action == "pause")
        # hold and go: the agent stops the whole process while every member must yield (one yield rule per group)

    def add(self, spec: TrainerSpec) -> None:
        """The session joins (the base is loaded with the first); one that cannot join fails alone, saying why."""
        present = self.members.get(spec.job)
        if present is not None:
            if present.attempt >= spec.attempt:
                return  # the same line again, or an older attempt's
            note(f"job {spec.job}: attempt {present.attempt} leaves the group, superseded by attempt {spec.attempt}")
            self.drop(spec.job)
        try:
            if self.held.admit(spec):
                assert self.held.model is not None
                self.vocab = self.held.model.get_output_embeddings().weight.shape[0]
                self.base = SharedBase(self.held.model)
            assert self.base is not None
            member = SessionMember(spec, self.base, self.held.tokenizer, self.vocab, self.held.device)
        except OtherWeights as e:
            emit(GroupEvent(job=spec.job, attempt=spec.attempt, event=Requeue(step=0, message=str(e))))
            return
        except (JobError, msgspec.ValidationError, OSError) as e:
            emit(GroupEvent(job=spec.job, attempt=spec.attempt, event=Failed(message=str(e))))
            return
        except Exception as e:
            traceback.print_exc()
            emit(GroupEvent(job=spec.job, attempt=spec.attempt, event=Failed(message=f"the trainer failed: {e!r}")))
            return
        self.members[spec.job], self.waiting[spec.job], self.last[spec.job] = member, collections.deque(), _now()
        resumed = f"; resumed from step {member.step}" if spec.resume_from or spec.init_adapter else ""
        member.emit(Started(steps=0, examples=0, device=member.device, message=f"session ready{resumed}"))

    def drop(self, job: str) -> None:
        """The member leaves now: its LoRA comes off the base; calls it had waiting are told to ask again."""
        member = self.members.pop(job)
        self.last.pop(job, None)
        self.kind.pop(job, None)
        self.back.pop(job, None)
        if self.base is not None:
            self.base.detach(job)
        for line in self.waiting.pop(job, ()):
            self.answer(line, CallError(message=f"session {job} left its group; ask again", retry=True))
        del member

    def end(self, job: str, pause: bool, why: str = "") -> None:
        """Stopped (its adapter saved) or paused (a checkpoint to go on from), then it leaves."""
        member = self.members[job]
        event: Finished | Failed
        try:
            with member.own_random_state():
                event = member.end(pause, why)
        except Exception as e:  # saving it: its neighbours go on
            traceback.print_exc()
            event = Failed(message=f"the session could not be {'paused' if pause else 'stopped'}: {e!r}")
        member.emit(event)
        self.drop(job)

    def idle_out(self) -> None:
        """Members no call came for in their idle_s: checkpointed and paused, their devices' share freed."""
        now = _now()
        for job, member in list(self.members.items()):
            s = member.spec.request.session
            idle_s = s.idle_s if s is not None else 900.0
            if not self.waiting[job] and now - self.last[job] > idle_s:
                why = f"no call for {idle_s:.0f} s: checkpointed at step {member.step}; the next call resumes it"
                self.end(job, pause=True, why=why)

    # --- calls ----------------------------------------------------------------------------------------------------
    def take(self, line: MemberCall) -> None:
        member = self.members.get(line.job)
        if member is None or member.attempt != line.attempt:
            self.answer(line, CallError(message=f"session {line.job} does not run in this group; ask again", retry=True))  # fmt: skip
            return
        if (known := member.applied.answer(line.call_id)) is not None:  # it ran already: answered as it was
            self.answer(line, known)
            return
        if batchable(line.call) and self.kind.get(line.job) not in (None, ForwardBackward):
            back = _now() - self.last[line.job]  # since the answer before it
            self.back[line.job] = back if line.job not in self.back else 0.5 * (self.back[line.job] + back)
        self.waiting[line.job].append(line)
        self.kind[line.job] = type(line.call)

    def answer(self, line: MemberCall, reply: SessionReply) -> None:
        emit(MemberAnswer(job=line.job, attempt=line.attempt, id=line.id, reply=reply))
        if line.job in self.last:
            self.last[line.job] = _now()

    def short(self) -> bool:
        """A member's forward_backward that trains is next, and another member is due to send one within wait_s:
        it stepped (its last call was not a forward_backward), nothing of it waits, and its forward_backwards
        lately came within wait_s of the answer before them, which was less than wait_s ago. Clients that step
        together (one program driving several sessions) send their forward_backwards a moment apart: waiting for
        them puts them in one pass of the base. A member whose calls come further apart is not waited for."""
        if not self.batch or len(self.members) < 2:
            return False
        if not any(q and batchable(q[0].call) for q in self.waiting.values()):
            return False
        now = _now()
        return any(
            not self.waiting[job]
            and self.kind.get(job) not in (None, ForwardBackward)
            and self.back.get(job, self.wait_s) < self.wait_s
            and now - self.last[job] < self.wait_s
            for job in self.members
        )

    def round(self) -> bool:
        """One call of every member that has one waiting, the first member taking turns; False: none was waiting."""
        jobs = list(self.members)
        start = self.turns % len(jobs) if jobs else 0
        heads = [self.waiting[job].popleft() for job in jobs[start:] + jobs[:start] if self.waiting[job]]
        if not heads:
            return False
        self.turns += 1
        if self.batch:
            heads = self._together(heads)
        ran = [self.members[line.job] for line in heads]
        for line, member in zip(heads, ran):
            with member.own_random_state():
                reply = member.take(line.call, line.call_id)
            self.answer(line, reply)
        for member in ran:  # every answer of the round out before any Progress (the agent stores each as it reads)
            member.said()
        return True

    def _together(self, heads: list[MemberCall]) -> list[MemberCall]:
        """The members' forward_backwards that train run in one pass; the calls left to run one by one."""
        shared = []
        for line in heads:
            if batchable(line.call):
                try:
                    ops.check_batch(line.call, self.vocab)  # type: ignore[arg-type]
                    shared.append(line)
                except ops.CallRefused:
                    pass  # refused when it runs alone, naming its field
        if len(shared) < 2:
            return heads
        assert self.base is not None
        work = [(self.members[line.job], line.call) for line in shared]
        try:
            results = forward_backward_together(self.base, work, self.held.device)  # type: ignore[arg-type]
        except Exception as e:  # each runs alone: a call that fails fails alone
            note(f"a shared forward_backward of {len(shared)} sessions failed ({e!r}); each runs on its own")
            return heads
        for line, result in zip(shared, results):
            self.members[line.job].applied.remember(line.call_id, line.call, result)
            self.answer(line, result)
        return [line for line in heads if line not in shared]


def serve_sessions(controls: Controls, lines: list) -> int:
    """Run the group until its stdin is closed and no member is left."""
    wait_s = float(os.environ.get(WAIT_ENV, WAIT_MS)) / 1000
    group = SessionGroup(batch=os.environ.get(BATCH_ENV, "on") != "off", wait_s=wait_s)
    while True:
        handle_all(group, lines)
        deadline = _now() + wait_s
        while group.short() and not controls.closed and (left := deadline - _now()) > 0:
            handle_all(group, controls.take(wait=True, timeout=left))  # the members due, for one pass
        busy = group.round()
        group.idle_out()
        if controls.closed:
            for job in list(group.members):  # no call can come any more: each goes on from a checkpoint
                group.end(job, pause=True, why="the agent closed the session group's input")
            return 0
        lines = controls.take(wait=not busy, timeout=POLL_S)


def handle_all(group: SessionGroup, lines: list) -> None:
    for line in lines:
        try:
            group.handle(line)
        except Exception as e:  # one session's line: the others go on
            traceback.print_exc()
            if isinstance(line, MemberCall):
                group.answer(line, CallError(message=f"the call failed: {type(e).__name__}: {e}"))
            else:
                attempt = line.spec.attempt if line.spec else line.attempt
                emit(GroupEvent(job=line.job, attempt=attempt, event=Failed(message=f"the trainer failed: {e!r}")))


def _now() -> float:
    return time.monotonic()
