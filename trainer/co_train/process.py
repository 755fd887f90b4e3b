"""A co-training group's trainer process, top to bottom: the agent's lines on stdin (schemas/events.py
GroupControl) are taken between steps; a job joins (the base is loaded with the first; a later one only onto the
same content, schemas/weights_digest.py), steps with the others, reports as a trainer alone does (each of its events
on stdout as a GroupEvent, with its attempt), and leaves when it ends, fails, is cancelled, stopped or paused. A
job's failure is its own: its neighbours go on; a step that runs out of memory splits the group (split.py). The
process ends once its stdin is closed and no job is left. A group whose first job is a Tinker session is a session
group instead (trainer/session/group.py)."""

from __future__ import annotations

import traceback

import msgspec
import torch

from schemas.co_train import SESSION
from schemas.events import Failed, Finished, GroupControl, GroupEvent, Requeue, TrainerSpec
from trainer import lease
from trainer.multi_lora.controls import Controls, addressed, note
from trainer.co_train.group import CoTrainer, StepOutOfMemory
from trainer.multi_lora.held_base import HeldBase, OtherWeights
from trainer.co_train.member import Member, member_for
from trainer.co_train.split import leave_for_memory
from trainer.errors import JobError
from trainer.events import emit


class Group:
    """The shared base (loaded with the first job) and the jobs training on it, one attempt of each."""

    def __init__(self) -> None:
        self.trainer: CoTrainer | None = None
        self.held = HeldBase()
        self.members: dict[str, Member] = {}

    @property
    def device(self) -> str:
        return self.held.device

    @property
    def all_held(self) -> bool:
        return bool(self.members) and all(m.job.held for m in self.members.values())

    def handle(self, c: GroupControl) -> None:
        if c.action == "add" and c.spec is not None:
            self.add(c.spec)
            return
        member = addressed(self.members, c)
        if member is None:
            return
        if c.action == "cancel":
            self.drop(c.job)
        elif c.action in ("hold", "go"):
            member.job.held = c.action == "hold"
        elif member.asked != "pause":  # a pause asked stays one
            member.asked = c.action

    def add(self, spec: TrainerSpec) -> None:
        """The job joins from the next step on; a job that cannot join fails alone, saying why (one whose base is
        not this group's content is handed back to be placed again, alone)."""
        present = self.members.get(spec.job)
        if present is not None:
            if present.attempt >= spec.attempt:
                return  # the same line again, or an older attempt's: the group holds the newer
            note(f"job {spec.job}: attempt {present.attempt} leaves the group, superseded by attempt {spec.attempt}")
            self.drop(spec.job)
        try:
            trainer = self._trainer_for(spec)
            job = trainer.add_job(spec)
            try:
                self.members[spec.job] = member_for(job, self.device, trainer.tokenizer)
            except BaseException:
                trainer.remove_job(spec.job)
                raise
        except OtherWeights as e:
            emit(GroupEvent(job=spec.job, attempt=spec.attempt, event=Requeue(step=0, message=str(e))))
        except (JobError, msgspec.ValidationError, OSError) as e:
            emit(GroupEvent(job=spec.job, attempt=spec.attempt, event=Failed(message=str(e))))
        except Exception as e:
            traceback.print_exc()
            emit(GroupEvent(job=spec.job, attempt=spec.attempt, event=Failed(message=f"the trainer failed: {e!r}")))

    def _trainer_for(self, spec: TrainerSpec) -> CoTrainer:
        if self.held.admit(spec):  # the first job: the base is loaded now
            held = self.held
            assert held.tokenizer is not None  # admit loaded it
            autocast = held.dtype if held.device == "cuda" else torch.float32
            self.trainer = CoTrainer(held.model, held.tokenizer, held.device, autocast)
        assert self.trainer is not None
        return self.trainer

    def drop(self, job: str) -> None:
        """The job leaves now (cancelled, ended, superseded or split out): its LoRA comes off the base, its logs are
        closed."""
        member = self.members.pop(job)
        if self.trainer is not None and job in self.trainer.jobs:
            self.trainer.remove_job(job)
        try:
            member.board.close()
        except OSError as e:  # a cancelled job's directory may be gone already: its logs are of no use then
            note(f"job {job}: its logs were not closed ({e})")

    def step(self) -> None:
        """One forward and backward of every job not held, each job's step where its accumulation completes; then
        each stepped job does what a trainer alone does after a step, and the jobs that ended or failed leave. A
        step that ran out of memory was undone: its largest job leaves, and the rest take the step again."""
        assert self.trainer is not None, "a group steps once a job has joined"
        lease.hold_while_lapsed()  # the agent cannot vouch for these attempts now: no step until it can
        try:
            results = self.trainer.step()
        except StepOutOfMemory as oom:
            leave_for_memory(self, oom)
            return
        for name, job in list(self.trainer.jobs.items()):
            if job.state == "failed":
                self._end(name, Failed(message=job.message))
        for name, result in results.items():
            if name not in self.members:
                continue
            finished: Finished | Failed | None
            try:
                finished = self.members[name].after_step(result)
            except JobError as e:
                finished = Failed(message=str(e))
            except Exception as e:  # saving or evaluating this job: its neighbours go on
                traceback.print_exc()
                finished = Failed(message=f"the trainer failed: {e!r}")
            if finished is not None:
                self._end(name, finished)

    def _end(self, job: str, event) -> None:
        if job in self.members:
            self.members[job].emit(event)
            self.drop(job)
        elif self.trainer is not None and job in self.trainer.jobs:
            spec = self.trainer.jobs[job].spec
            emit(GroupEvent(job=job, attempt=spec.attempt, event=event))
            self.trainer.remove_job(job)


def serve(stream) -> int:
    """Run the group until stdin is closed and no job is left in it: a group of training jobs, or of sessions
    (trainer/session/group.py) when its first job is one."""
    controls = Controls(stream)
    first = controls.take(wait=True)
    if any(isinstance(c, GroupControl) and c.spec is not None and _session(c.spec) for c in first):
        from trainer.session.group import serve_sessions  # torch and peft's session pieces, for sessions alone

        return serve_sessions(controls, first)
    return serve_jobs(controls, first)


def _session(spec: TrainerSpec) -> bool:
    return spec.request.train.method == SESSION


def serve_jobs(controls: Controls, lines: list) -> int:
    group = Group()
    while True:
        for c in lines:
            if not isinstance(c, GroupControl):
                note(f"a session's call for job {c.job} left: this group trains jobs, not sessions")
                continue
            try:
                group.handle(c)
            except Exception as e:  # one job's line: the others go on
                traceback.print_exc()
                event = Failed(message=f"the trainer failed: {e!r}")
                emit(GroupEvent(job=c.job, attempt=c.spec.attempt if c.spec else c.attempt, event=event))
        if not group.members and controls.closed:
            return 0
        if group.members and group.all_held and controls.closed:
            for member in group.members.values():  # nobody is left to let them go on
                member.job.held = False
        if group.members and not group.all_held:
            if lease.hold_while_lapsed():  # what the agent said while it could not vouch for us (an end) comes first
                lines = controls.take(wait=False)
                continue
            try:
                group.step()
            except Exception as e:  # the shared forward or backward: every job here goes with it
                traceback.print_exc()
                for member in list(group.members.values()):
                    member.emit(Failed(message=f"the co-training group's step failed: {e!r}"))
                return 1
        lines = controls.take(wait=not group.members or group.all_held)
