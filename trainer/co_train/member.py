"""One job of a group as the agent sees it: everything a trainer alone does around its steps, done for this job
in the group (trainer/job/loop.py's pieces, reused): its Started event, progress every logging_steps, evaluation with
early stopping and keep-best, samples, checkpoints at save_steps in trainer/job/checkpoints.py's layout (so a paused
job resumes alone or in another group), TensorBoard and trackers, and its end (trained, stopped, paused) with the
adapter saved in peft's layout and the probe an engine serving it must answer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from schemas.events import Checkpoint, Finished, GroupEvent, PreferenceMetrics, Progress, Started
from trainer.job.best import BestEval
from trainer.job.checkpoints import TrainingState, resume, save_checkpoint
from trainer.co_train.job import CoJob, StepResult
from trainer.multi_lora.peft_export import PREFIX, save_peft_adapter
from trainer.multi_lora.shared_base import JobView
from trainer.job.distributed import World
from trainer.events import emit
from trainer.job.ending import AdapterOut, Ending, finish
from trainer.job.loop import peak_mib
from trainer.samples import probe, sample_prompts, samples_event
from trainer.job.tensorboard_log import TensorBoardLog
from trainer.job.trackers import RunLogs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class JobModel(JobView):
    """The job's adapter on the shared base, as the trainer's shared pieces take a job's peft model: its named
    LoRA weights (peft's names: keep-best and checkpoints carry over between a group and a trainer alone),
    save_pretrained in peft's layout, and generate for samples and the probe."""

    def __init__(self, job: CoJob) -> None:
        super().__init__(job.view.base, job.name)
        self.co_job = job

    def named_parameters(self):
        for module, w in self.co_job.weights.items():
            yield f"{PREFIX}{module}.lora_A.default.weight", w.A
            yield f"{PREFIX}{module}.lora_B.default.weight", w.B

    def parameters(self):
        return self.base.model.parameters()

    def save_pretrained(self, out, **_) -> None:
        spec = self.co_job.spec
        save_peft_adapter(self.co_job.weights, spec.request.lora, spec.request.base_dir, Path(out))

    def load_adapter_weights(self, state: dict[str, torch.Tensor]) -> None:
        """A saved adapter's weights (peft's key names) put into the job's LoRA."""
        with torch.no_grad():
            for module, w in self.co_job.weights.items():
                w.A.copy_(state[f"{PREFIX}{module}.lora_A.weight"])
                w.B.copy_(state[f"{PREFIX}{module}.lora_B.weight"])

    def generate(self, **inputs):
        with self.active():
            return self.base.model.generate(**inputs)


@dataclass
class Member:
    job: CoJob
    model: JobModel
    device: str
    best: BestEval
    prompts: list
    board: RunLogs
    tokenizer: PreTrainedTokenizerBase
    started: float = field(default_factory=time.monotonic)
    window: list[float] = field(default_factory=list)  # the losses since the last progress event
    evaluated: float | None = None
    asked: str = ""  # "stop" or "pause": end after the step under way
    resumed_from: int | None = None

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def out_dir(self) -> Path:
        return Path(self.job.spec.out_dir)

    @property
    def attempt(self) -> int:
        return self.job.spec.attempt

    def emit(self, event) -> None:
        emit(GroupEvent(job=self.job.spec.job, attempt=self.attempt, event=event))

    def publish(self, event) -> None:
        self.emit(event)
        self.board.progress(event) if isinstance(event, Progress) else self.board.samples(event)

    def after_step(self, result: StepResult) -> Finished | None:
        """What a trainer alone does after a step: evaluate, report, checkpoint; the job's end when this step was
        its last (its plan's end, a stop or pause asked, or early stopping)."""
        t, at = self.job.train, self.job.at
        self.window.append(result.loss)
        last = bool(self.asked) or at.step >= self.job.plan.steps
        early = ""
        if len(self.job.eval_set) and ((t.eval_steps and at.step % t.eval_steps == 0) or last):
            early = self.evaluate()
            last = last or bool(early)
            if self.prompts:
                self.samples()
        if at.step % t.logging_steps == 0 or last:
            self.publish(self.progress(result, early))
            self.window = []
        paused = last and self.asked == "pause"
        if (t.save_steps and at.step % t.save_steps == 0 and not last) or paused:
            self.checkpoint()
        return self.end(paused, early) if last else None

    def evaluate(self) -> str:
        t = self.job.train
        self.evaluated = self.job.evaluate(self.device)
        if self.evaluated is None:
            return ""
        self.best.observe(self.job.at.step, self.evaluated, self.model)
        self.board.evaluation(self.job.at.step, self.evaluated, "loss")
        return self.best.why_stopped(t.early_stopping_min_delta) if self.best.should_stop else ""

    def samples(self, base: bool = False) -> None:
        t = self.job.train
        self.publish(
            samples_event(
                self.model, self.tokenizer, self.prompts, self.device, t.sample_max_tokens,
                self.job.at.step, base=base,
            )
        )  # fmt: skip

    def progress(self, result: StepResult, early: str) -> Progress:
        at, steps, elapsed = self.job.at, self.job.plan.steps, time.monotonic() - self.started
        figures = self.job.objective.metrics(World())
        epoch = at.epoch + at.batch_in_epoch / max(len(self.job._epoch_batches or [None]), 1)
        done = at.step - (self.resumed_from or 0)
        return Progress(
            step=at.step,
            steps=steps,
            epoch=epoch,
            loss=sum(self.window) / max(len(self.window), 1),
            lr=result.lr,
            grad_norm=result.grad_norm,
            tokens=at.tokens,
            tokens_per_s=at.tokens / elapsed if elapsed > 0 else None,
            elapsed_s=elapsed,
            eta_s=elapsed / max(done, 1) * (steps - at.step),
            peak_mib=peak_mib(self.device),
            eval_loss=self.evaluated,
            message=early,
            preference=figures if isinstance(figures, PreferenceMetrics) else None,
        )

    def checkpoint(self) -> None:
        path = self.save()
        self.emit(Checkpoint(step=self.job.at.step, path=str(path)))

    def save(self) -> Path:
        """A checkpoint of where the job stands (between its steps), in trainer/job/checkpoints.py's layout."""
        j, at = self.job, self.job.at
        path = save_checkpoint(TrainingState(self.model, j.optimizer, j.scheduler), at, self.out_dir, self.best.state())
        self.board.copy_into(path)
        return path

    def end(self, paused: bool, early: str) -> Finished:
        """Save the adapter (paused: the checkpoint just taken is it) and say how the job ended."""
        self.board.close()
        j = self.job
        done = finish(self.model, self.best, Ending(j.at.step, j.plan.steps, paused, early), AdapterOut(self.out_dir))
        if done.state != "paused":
            done = msgspec.structs.replace(done, probe=probe(self.model, self.tokenizer, self.device))
        return done


def member_for(job: CoJob, device: str, tokenizer: PreTrainedTokenizerBase) -> Member:
    """The job's part around its steps; resumed from its checkpoint when its spec names one; announced."""
    spec, t = job.spec, job.train
    model = JobModel(job)
    carried = Path(spec.resume_from) if spec.resume_from else None
    member = Member(
        job=job,
        model=model,
        device=device,
        best=BestEval(
            t.early_stopping_patience,
            t.early_stopping_min_delta,
            keep=bool(len(job.eval_set)) if t.keep_best is None else t.keep_best,
        ),
        prompts=sample_prompts(t.sample_prompts, tokenizer, job.eval_set, job.train_set),
        tokenizer=tokenizer,
        board=RunLogs(TensorBoardLog(Path(spec.out_dir) / "tensorboard", carried_from=carried), spec, spec.out_dir),
    )
    if carried:
        state = resume(TrainingState(model, job.optimizer, job.scheduler), carried, load=model.load_adapter_weights)
        at = job.at
        at.step, at.tokens, at.epoch, at.batch_in_epoch = (
            state["step"], state.get("tokens", 0), state["epoch"], state["batch_in_epoch"]
        )  # fmt: skip
        member.best.load(state["best"])
        member.resumed_from = at.step
    announce(member)
    if member.prompts and job.at.step == 0:
        member.samples(base=True)
    return member


def announce(member: Member) -> None:
    j = member.job
    resumed = f", resumed from step {member.resumed_from}" if member.resumed_from is not None else ""
    member.emit(
        Started(
            steps=j.plan.steps,
            examples=len(j.train_set),
            eval_examples=len(j.eval_set),
            device=member.device,
            message=f"training {j.plan.steps} steps on {member.device} in a co-training group "
            f"({len(j.train_set)} examples, {j.plan.per_epoch} steps/epoch){resumed}",
        )
    )
