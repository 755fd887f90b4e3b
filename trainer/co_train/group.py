"""K jobs training their adapters on one frozen base in one process, top to bottom: each forward takes the next
micro-batch of every running job, stacked; the base runs once for all rows and each layer adds each job's LoRA to
its own rows; each job's loss comes from its own rows; one backward over their sum (the jobs' parameters are
disjoint and each loss depends only on its own rows, so each job's gradient is its own loss's); then every job at
the end of its accumulation clips and steps on its own. A job whose loss is not a number fails alone; jobs join
and leave between forwards."""

from __future__ import annotations

import torch

from schemas.events import TrainerSpec
from trainer.co_train.combine import combine
from trainer.co_train.job import CoJob, StepResult, job_from_spec
from trainer.co_train.job_losses import job_loss, reference_outputs
from trainer.co_train.shared_base import SharedBase
from trainer.errors import JobError
from trainer.objectives import Dpo


class CoTrainer:
    """A group: the shared base and its jobs, by name."""

    def __init__(self, model: torch.nn.Module, tokenizer, device: str = "cpu", dtype=torch.float32) -> None:
        self.base = SharedBase(model, dtype)
        self.tokenizer, self.device = tokenizer, device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.jobs: dict[str, CoJob] = {}

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
        return [j for j in self.jobs.values() if j.running]

    def step(self) -> dict[str, StepResult]:
        """One forward and backward over the next micro-batch of every running job; the jobs whose step that
        completed are stepped. Returns their results, by job; a job failed here is left failed in self.jobs."""
        return {j.name: j.optimizer_step() for j in self.forward_backward()}

    def forward_backward(self) -> list[CoJob]:
        """The next micro-batch of every running job in one forward, and one backward over their summed losses;
        returns the jobs whose step that micro-batch completed (their gradients are ready)."""
        jobs = self.running
        if not jobs:
            return []
        micro = {j.name: j.next_micro_batch(self.device) for j in jobs}
        combined = combine(micro, self.pad_id)
        dpo = [j.name for j in jobs if isinstance(j.objective, Dpo)]
        referenced = reference_outputs(self.base, micro, dpo, self.pad_id)
        with self.base.routed(combined.routing):
            out = self.base.output(combined.batch)
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
        return [j for j in jobs if j.running and j.step_complete]

    def run(self) -> None:
        """Forward after forward while any job runs."""
        while self.running:
            self.step()
