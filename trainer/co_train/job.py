"""One job of a group, with everything it keeps of its own: its adapter's weights, optimizer and its state, lr
schedule, step counter, data order and seed, gradient accumulation and clipping, and its losses. Built from the
same TrainerSpec the agent writes for a job trained alone, with the same pieces (tokenizing, batches, plan,
optimizer, schedule, objective)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import get_scheduler

from schemas.co_train import METHODS
from schemas.events import TrainerSpec
from trainer.data import examples as data
from trainer.multi_lora.layer import LoraWeights
from trainer.multi_lora.shared_base import JobView, SharedBase
from trainer.errors import JobError
from trainer.model import pad_id
from trainer.objectives.objective import Dpo, Sft, token_objective
from trainer.optimizers import make_optimizer
from trainer.job.position import Position
from trainer.job.setup import Plan, plan
from trainer.data.tokenize import job_data


@dataclass
class StepResult:
    """What one optimizer step of a job did (what a progress event reports)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int


@dataclass
class CoJob:
    """A job training its adapter in a group. The group asks it for its next micro-batch each forward, gives it
    that micro-batch's loss, and after its last micro-batch of a step, steps it."""

    spec: TrainerSpec
    train_set: Any
    eval_set: Any
    pad_id: int
    weights: dict[str, LoraWeights]  # module name -> its LoRA, in model order
    optimizer: torch.optim.Optimizer
    scheduler: Any
    plan: Plan
    objective: Sft | Dpo
    view: JobView  # the job's adapter alone on the base, for evaluation and samples
    at: Position = field(default_factory=Position)
    state: str = "running"  # running, trained, failed
    held: bool = False  # yielding to a serving engine: it sits out forwards until let go on
    message: str = ""
    history: list[StepResult] = field(default_factory=list)
    _epoch_batches: Any = None
    _step_micro: list = field(default_factory=list)  # this step's micro-batches not yet taken
    _step_count: int = 0  # target tokens (dpo: pairs) in this step: its loss is the mean over them
    _step_loss: float = 0.0
    _step_tokens: int = 0
    _draws: list = field(default_factory=list)  # its dropout generators' states as its step began

    @property
    def name(self) -> str:
        return self.spec.job

    @property
    def train(self):
        return self.spec.request.train

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """A then B of each layer, in model order: as peft lists them."""
        return [p for w in self.weights.values() for p in (w.A, w.B)]

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def rows_per_step(self) -> int:
        """Its share of a forward: its micro-batch's rows, in proportion to its batch size."""
        return self.train.batch_size * (2 if self.train.method == "dpo" else 1)

    def next_micro_batch(self, device: str) -> data.Batch:
        """The next micro-batch of its data, in its own order (a new step's first one starts the step)."""
        if not self._step_micro:
            self._start_step()
        return self._step_micro.pop(0).to(device)

    def _start_step(self) -> None:
        if self._epoch_batches is None:
            t, epoch = self.train, self.at.epoch
            self._epoch_batches = data.make_batches(self.train_set, t, self.pad_id, epoch)
        first = self.at.batch_in_epoch
        self._step_micro = [b for b in self._epoch_batches[first : first + self.train.grad_accum] if b is not None]
        self._step_count = sum(self.objective.count(b) for b in self._step_micro)
        self._step_loss, self._step_tokens = 0.0, 0
        self._draws = [w.generator.get_state() for w in self.weights.values() if w.generator is not None]

    def undo_step(self) -> None:
        """The step under way begins again from its first micro-batch, as if it never began: its gradients, loss
        and dropout draws as they were (a shared forward that ran out of memory)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._step_micro = []
        generators = [w.generator for w in self.weights.values() if w.generator is not None]
        for generator, state in zip(generators, self._draws, strict=False):
            generator.set_state(state)

    def scaled(self, summed_loss: torch.Tensor, batch: data.Batch) -> torch.Tensor:
        """A micro-batch's summed loss as its part of the step's mean; counted into the step's loss."""
        loss = summed_loss / max(self._step_count, 1)
        self._step_loss += float(loss.detach())
        self._step_tokens += batch.tokens
        return loss

    @property
    def step_complete(self) -> bool:
        return not self._step_micro

    def optimizer_step(self) -> StepResult:
        """Clip its gradients by its own norm, step its optimizer and schedule, and move its data on."""
        t = self.train
        norm = torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm or float("inf"), foreach=True)
        grad_norm = float(norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.at.step += 1
        self.at.tokens += self._step_tokens
        self.at.batch_in_epoch += t.grad_accum
        if self.at.batch_in_epoch >= len(self._epoch_batches):
            self.at.epoch, self.at.batch_in_epoch, self._epoch_batches = self.at.epoch + 1, 0, None
        result = StepResult(self.at.step, self._step_loss, grad_norm, lr, self._step_tokens)
        self.history.append(result)
        if self.at.step >= self.plan.steps:
            self.state, self.message = "trained", f"trained {self.at.step} steps"
        return result

    def check_finite(self, loss: torch.Tensor) -> bool:
        """Whether a micro-batch's loss is a number; if not, the job fails, saying so as a job alone would."""
        value = float(loss.detach())
        if math.isfinite(value):
            return True
        self.fail(
            f"the loss became {value} at step {self.at.step + 1}; lower train.learning_rate "
            f"(now {self.train.learning_rate}) or check the data"
        )
        return False

    def evaluate(self, device: str) -> float | None:
        """Its mean held-out loss (per target token, or per pair) with its adapter alone on the base, as a job alone
        evaluates (trainer/job/loop.py's evaluate); between forwards of the group. None without held-out examples."""
        from trainer.job.loop import evaluate

        batches = data.make_batches(self.eval_set, self.train, self.pad_id, 0) if len(self.eval_set) else []
        with self.view.active():
            chunk = self.train.loss_chunk_tokens
            return evaluate(self.view, batches, device, self.view.base.autocast_dtype, chunk, objective=self.objective)

    def fail(self, message: str) -> None:
        self.state, self.message = "failed", message
        self.optimizer.zero_grad(set_to_none=True)


def job_from_spec(spec: TrainerSpec, base: SharedBase, tokenizer, device: str) -> CoJob:
    """A job ready to join the group on `base`: its data tokenized and in its own order, its LoRA attached."""
    t = spec.request.train
    if t.method not in METHODS:
        raise JobError(f"train.method {t.method} is not co-trained; a group trains {METHODS} jobs")
    if spec.init_adapter:
        raise JobError("a job that starts from init_adapter trains alone, not in a co-training group")
    pad = pad_id(tokenizer)
    train_set, eval_set = job_data(spec, tokenizer)
    steps = plan(len(data.make_batches(train_set, t, pad, 0)), t)
    weights = base.attach(spec.job, spec.request.lora, t.seed)
    params = [p for w in weights.values() for p in (w.A, w.B)]
    optimizer = one_call_steps(make_optimizer(params, t, device))
    return CoJob(
        spec=spec,
        train_set=train_set,
        eval_set=eval_set,
        pad_id=pad,
        weights=weights,
        optimizer=optimizer,
        scheduler=get_scheduler(
            t.lr_scheduler, optimizer, num_warmup_steps=steps.warmup, num_training_steps=steps.steps
        ),
        plan=steps,
        objective=token_objective(t, base.autocast_dtype),
        view=JobView(base, spec.job),
    )


def one_call_steps(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer stepping the adapter's tensors in one call, before its first step: AdamW torch's fused kernel
    (the CPU has one: 1.0-1.7 ms a step for a LoRA on every linear of 6 layers, where foreach took 2.8-7.1 and the
    loop 4.9-8.9), the others foreach. The same update, to rounding."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fused = type(optimizer) is torch.optim.AdamW and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )
    for group in optimizer.param_groups:
        if fused and not group.get("differentiable"):
            group["fused"], group["foreach"] = True, False
        elif "foreach" in group:
            group["foreach"] = True
    return optimizer
