"""K jobs training their adapters on one frozen base in one process, top to bottom: each forward takes the next
micro-batch of every running job, laid out together (trainer/co_train/combine.py); the base runs once for all of
them and each layer adds each job's LoRA to its own part; each job's loss comes from its own part; one backward
over their sum (the jobs' parameters are disjoint and each loss depends only on its own part, so each job's
gradient is its own loss's); then every job at the end of its accumulation clips and steps on its own. A job whose
loss is not a number fails alone; jobs join and leave between forwards, and a held job (yielding to a serving
engine) sits out forwards until it is let go on. A forward or backward that runs out of memory is undone for every
job (each begins its step again) and raised as StepOutOfMemory, for the process to split the group."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from schemas.events import TrainerSpec
from trainer.co_train.combine import alike_together, combine
from trainer.co_train.job import CoJob, StepResult, job_from_spec
from trainer.co_train.job_losses import job_loss, reference_outputs
from trainer.multi_lora.shared_base import SharedBase
from trainer.errors import JobError
from trainer.model import pad_id
from trainer.objectives.objective import Dpo

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer.model import CausalLM

OOM_FAULT_ENV = "JETLORA_CO_TRAIN_OOM_ABOVE"  # tests only: a step of several jobs over this many token positions
# fails as out of memory after its forward (a CPU has no device memory to run out of), through the real split path


class StepOutOfMemory(Exception):
    """The shared step ran out of memory; every job's step under way was undone. `positions`: each job's token
    positions in that step (what it added to the step's activations)."""

    def __init__(self, positions: dict[str, int], error: str) -> None:
        super().__init__(f"the shared step ran out of memory: {error}")
        self.positions, self.error = positions, error

    @property
    def largest(self) -> str:
        """The job that took the most of the step (ties: by name, so that the choice is the same every time)."""
        return max(self.positions, key=lambda job: (self.positions[job], job))


class CoTrainer:
    """A group: the shared base and its jobs, by name."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: PreTrainedTokenizerBase,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        flat: bool = True,
    ) -> None:
        self.base = SharedBase(model, dtype)
        self.tokenizer, self.device = tokenizer, device
        self.pad_id = pad_id(tokenizer)
        self.jobs: dict[str, CoJob] = {}
        self.oom_above = int(os.environ.get(OOM_FAULT_ENV) or 0)
        self.flat = flat  # the flat layout where the model allows it (False: padded, as bench/co_train.py compares)
        self.last_positions = 0  # token positions the last forward held (its batch's size)

    def add_job(self, spec: TrainerSpec) -> CoJob:
        """A job joins: it takes part from the next forward on; the others' state is left as it was."""
        if spec.job in self.jobs:
            raise JobError(f"job {spec.job} is already in this group")
        self.jobs[spec.job] = job_from_spec(spec, self.base, self.tokenizer, self.device)
        return self.jobs[spec.job]

    def remove_job(self, name: str) -> CoJob:
        """A job leaves (ended, cancelled, failed or moved): its LoRA comes off the base; returned, with its state,
        for whoever saves it."""
        job = self.jobs.pop(name)
        self.base.detach(name)
        job.optimizer.zero_grad(set_to_none=True)
        return job

    @property
    def running(self) -> list[CoJob]:
        """The jobs that take part in the next forward: running, and not held."""
        return [j for j in self.jobs.values() if j.running and not j.held]

    def step(self) -> dict[str, StepResult]:
        """One forward and backward over the next micro-batch of every running job; the jobs whose step that
        completed are stepped. Returns their results, by job; a job failed here is left failed in self.jobs."""
        return {j.name: j.optimizer_step() for j in self.forward_backward()}

    def forward_backward(self) -> list[CoJob]:
        """The next micro-batch of every running job in one forward, and one backward over their summed losses;
        returns the jobs whose step that micro-batch completed (their gradients are ready). StepOutOfMemory when
        it ran out of memory (every job's step undone)."""
        jobs = self.running
        if not jobs:
            return []
        micro = alike_together({j.name: j.next_micro_batch(self.device) for j in jobs}, self._ranks(jobs))
        combined = combine(micro, self.pad_id, self.base.model if self.flat else None)
        self.last_positions = combined.batch.input_ids.numel()
        failed = ""
        try:
            self._forward_backward(jobs, micro, combined)
        except torch.OutOfMemoryError as e:  # what the step held goes with this block: the error's frames too
            failed = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
        if failed:
            for job in jobs:
                job.undo_step()
            if self.device == "cuda":
                torch.cuda.empty_cache()
            raise StepOutOfMemory({j.name: combined.positions(j.name) for j in jobs}, failed)
        return [j for j in jobs if j.running and j.step_complete]

    @staticmethod
    def _ranks(jobs: list[CoJob]) -> dict[str, int]:
        return {j.name: j.spec.request.lora.r for j in jobs}

    def _forward_backward(self, jobs: list[CoJob], micro: dict, combined) -> None:
        dpo = [j.name for j in jobs if isinstance(j.objective, Dpo)]
        referenced = reference_outputs(self.base, micro, dpo, self.pad_id)
        with self.base.routed(combined.routing):
            out = self.base.output(combined.batch, combined.layout)
        positions = combined.batch.input_ids.numel()
        if self.oom_above and len(jobs) > 1 and positions > self.oom_above:
            raise torch.OutOfMemoryError(f"{positions:,} token positions, over {OOM_FAULT_ENV}={self.oom_above:,}")
        total = None
        for job in jobs:
            loss = job_loss(self.base, job.objective, out, combined, job.name, referenced.get(job.name))
            loss = job.scaled(loss, micro[job.name])
            if job.check_finite(loss):
                total = loss if total is None else total + loss
            else:  # failed: its rows add nothing, its LoRA comes off the base; its neighbours go on
                self.base.detach(job.name)
        if total is not None:
            total.backward()

    def run(self) -> None:
        """Forward after forward while any job runs."""
        while self.running:
            self.step()
