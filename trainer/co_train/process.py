"""A co-training group's trainer process, top to bottom: the agent's lines on stdin (schemas/events.py
GroupControl) are taken between steps; a job joins (the base is loaded with the first), steps with the others,
reports as a trainer alone does (each of its events on stdout as a GroupEvent), and leaves when it ends, fails,
is cancelled, stopped or paused. A job's failure is its own: its neighbours go on. The process ends once its stdin
is closed and no job is left."""

from __future__ import annotations

import queue
import sys
import threading
import traceback

import msgspec
import torch

from schemas.co_train import same_weights
from schemas.events import Failed, GroupControl, GroupEvent, TrainerSpec
from trainer import lease
from trainer import model as base_model
from trainer.co_train.group import CoTrainer
from trainer.co_train.member import Member, member_for
from trainer.errors import JobError
from trainer.events import emit

_decode = msgspec.json.Decoder(GroupControl)


class Controls:
    """The agent's lines, read by a thread of their own so that a step never waits on stdin."""

    def __init__(self, stream) -> None:
        self.lines: queue.Queue[GroupControl | None] = queue.Queue()
        self.closed = False  # stdin ended: no job will join any more
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            if not line.strip():
                continue
            try:
                self.lines.put(_decode.decode(line))
            except msgspec.DecodeError as e:
                print(f"a control line that is not a GroupControl was left: {e}", file=sys.stderr, flush=True)
        self.lines.put(None)

    def take(self, wait: bool) -> list[GroupControl]:
        """The lines come since the last call; with `wait`, at least one (or stdin's end)."""
        out: list[GroupControl | None] = []
        if wait and not self.closed:
            out.append(self.lines.get())
        while True:
            try:
                out.append(self.lines.get_nowait())
            except queue.Empty:
                break
        self.closed = self.closed or None in out
        return [c for c in out if c is not None]


class Group:
    """The shared base (loaded with the first job) and the jobs training on it."""

    def __init__(self) -> None:
        self.trainer: CoTrainer | None = None
        self.key: tuple | None = None  # what every job of the group shares: base, precision, quantisation, device
        self.device = "cpu"
        self.members: dict[str, Member] = {}

    def handle(self, c: GroupControl) -> None:
        if c.action == "add" and c.spec is not None:
            self.add(c.spec)
        elif c.job in self.members:
            if c.action == "cancel":
                self.drop(c.job)
            elif self.members[c.job].asked != "pause":  # a pause asked stays one
                self.members[c.job].asked = c.action

    def add(self, spec: TrainerSpec) -> None:
        """The job joins from the next step on; a job that cannot join fails alone, saying why."""
        if spec.job in self.members:
            return  # the same job's line again: it is already here
        try:
            trainer = self._trainer_for(spec)
            job = trainer.add_job(spec)
            try:
                self.members[spec.job] = member_for(job, self.device, trainer.tokenizer)
            except BaseException:
                trainer.remove_job(spec.job)
                raise
        except (JobError, msgspec.ValidationError) as e:
            emit(GroupEvent(job=spec.job, event=Failed(message=str(e))))
        except Exception as e:
            traceback.print_exc()
            emit(GroupEvent(job=spec.job, event=Failed(message=f"the trainer failed: {e!r}")))

    def _trainer_for(self, spec: TrainerSpec) -> CoTrainer:
        r = spec.request
        if r.devices > 1:
            raise JobError(f"devices {r.devices}: a job on several devices trains alone, not in a co-training group")
        key = (r.base_dir, r.train.precision, r.quantization, spec.device)
        if self.key is not None and key[1:] == self.key[1:] and same_weights(r.base_dir, self.key[0]):
            key = self.key  # the same weights in another directory
        if self.trainer is None:
            self.device = spec.device if spec.device == "cpu" or torch.cuda.is_available() else "cpu"
            dtype = base_model.pick_dtype(r.train.precision, self.device)
            tokenizer, model = base_model.load(r.base_dir, self.device, dtype, r.quantization)
            autocast = dtype if self.device == "cuda" else torch.float32
            self.trainer, self.key = CoTrainer(model, tokenizer, self.device, autocast), key
        elif key != self.key:
            raise JobError(
                f"job {spec.job} (base_dir, precision, quantization, device = {key}) cannot join a group training "
                f"{self.key}; submit it with co_train: false to train alone"
            )
        return self.trainer

    def drop(self, job: str) -> None:
        """The job leaves now (cancelled, or ended): its LoRA comes off the base, its logs are closed."""
        member = self.members.pop(job)
        if self.trainer is not None and job in self.trainer.jobs:
            self.trainer.remove_job(job)
        try:
            member.board.close()
        except OSError as e:  # a cancelled job's directory may be gone already: its logs are of no use then
            print(f"job {job}: its logs were not closed ({e})", file=sys.stderr, flush=True)

    def step(self) -> None:
        """One forward and backward of every job, each job's step where its accumulation completes; then each
        stepped job does what a trainer alone does after a step, and the jobs that ended or failed leave."""
        assert self.trainer is not None, "a group steps once a job has joined"
        lease.hold_while_lapsed()  # the agent cannot vouch for these attempts now: no step until it can
        results = self.trainer.step()
        for name, job in list(self.trainer.jobs.items()):
            if job.state == "failed":
                self._end(name, Failed(message=job.message))
        for name, result in results.items():
            if name not in self.members:
                continue
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
        emit(GroupEvent(job=job, event=event))
        if job in self.members:
            self.drop(job)
        elif self.trainer is not None and job in self.trainer.jobs:
            self.trainer.remove_job(job)


def serve(stream) -> int:
    """Run the group until stdin is closed and no job is left in it."""
    controls, group = Controls(stream), Group()
    while True:
        for c in controls.take(wait=not group.members):
            try:
                group.handle(c)
            except Exception as e:  # one job's line: the others go on
                traceback.print_exc()
                emit(GroupEvent(job=c.job, event=Failed(message=f"the trainer failed: {e!r}")))
        if not group.members:
            if controls.closed:
                return 0
            continue
        try:
            group.step()
        except Exception as e:  # the shared forward or backward: every job here goes with it
            traceback.print_exc()
            for job in list(group.members):
                emit(GroupEvent(job=job, event=Failed(message=f"the co-training group's step failed: {e!r}")))
            return 1
