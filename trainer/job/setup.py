"""Everything a run needs before its first step: the model with its LoRA, the data in batches, the optimizer and
its schedule, and where the run resumes from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import set_seed
from peft import PeftModel, get_peft_model
from transformers import PreTrainedTokenizerBase, get_scheduler

from schemas.events import TrainerSpec
from trainer import model as base
from trainer.data import examples as data
from trainer.adapter_init import initial_weights, lora_config
from trainer.job.best import BestEval
from trainer.job.checkpoints import TrainingState, resume
from trainer.job.distributed import World
from trainer.objectives.dpo import REFERENCE
from trainer.errors import JobError
from trainer.events import mute
from trainer.objectives.objective import Dpo, Grpo, Sft, objective_for
from trainer.optimizers import make_optimizer
from trainer.job.position import Position
from trainer.objectives.rft import job_prompts
from trainer.samples import sample_prompts
from trainer.data.tokenize import job_data

if TYPE_CHECKING:
    from trainer.model import CausalLM


@dataclass
class Plan:
    steps: int
    per_epoch: int
    warmup: int


def plan(n_batches: int, t) -> Plan:
    per_epoch = max(1, math.ceil(n_batches / t.grad_accum))
    steps = t.max_steps or max(1, math.ceil(t.epochs * per_epoch))
    warmup = t.warmup_steps or math.ceil(t.warmup_ratio * steps)
    return Plan(steps, per_epoch, min(warmup, steps))


@dataclass
class Run:
    """A run ready to train: what the loop in trainer/job/loop.py reads and updates."""

    spec: TrainerSpec
    device: str
    world: World
    tokenizer: PreTrainedTokenizerBase
    model: PeftModel  # in train mode
    params: list[torch.nn.Parameter]  # the trainable (LoRA) weights
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None  # fp16 only
    autocast_dtype: torch.dtype
    pad_id: int
    train_set: Any
    eval_set: Any
    batches: data.EpochBatches
    eval_batches: data.EpochBatches
    plan: Plan
    best: BestEval
    prompts: list
    initial: Any  # pissa/loftq's starting weights, to save the adapter as a plain LoRA of the original base
    objective: Sft | Dpo | Grpo  # what a step minimises
    at: Position = field(default_factory=Position)
    resumed_from: int | None = None

    @property
    def out_dir(self) -> Path:
        return Path(self.spec.out_dir)


def lora_model(model: CausalLM, spec: TrainerSpec, device: str = "cpu") -> PeftModel:
    """The model with its trainable LoRA: a new one, or the registered adapter the job starts from (loaded a second
    time, frozen, as the reference `ref` of a dpo job or a grpo job with a KL term)."""
    if spec.init_adapter:
        adapted = PeftModel.from_pretrained(model, spec.init_adapter, is_trainable=True)
        t = spec.request.train
        if t.method == "dpo" or (t.method == "grpo" and t.grpo_beta > 0):
            adapted.load_adapter(spec.init_adapter, adapter_name=REFERENCE, is_trainable=False)
            adapted.set_adapter("default")
        return adapted
    lo = spec.request.lora
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in lo.target_modules if t not in present]
    if missing:
        raise JobError(f"lora.target_modules {missing} are not linear layers of this model; it has {sorted(present)}")
    return get_peft_model(model, lora_config(lo, device))


def prepare(spec: TrainerSpec) -> Run:
    """Load, wrap, batch and build the optimizer; resume from the spec's checkpoint if it names one."""
    t = spec.request.train
    device = spec.device if spec.device == "cpu" or torch.cuda.is_available() else "cpu"
    world = World.from_env(device)
    if not world.main:
        mute()
    set_seed(t.seed)
    dtype = base.pick_dtype(t.precision, device)
    tokenizer, loaded = base.load(spec.request.base_dir, device, dtype, spec.request.quantization)
    pad_id = base.pad_id(tokenizer)
    train_set, eval_set = _tokenized(spec, tokenizer, world)
    eval_batches = data.make_batches(eval_set, t, pad_id, 0, world.rank, world.size)
    batches = data.make_batches(train_set, t, pad_id, 0, world.rank, world.size)
    p = plan(len(batches), t)

    if t.gradient_checkpointing:
        loaded.gradient_checkpointing_enable()
        loaded.enable_input_require_grads()
    model = lora_model(loaded, spec, device)
    initial = initial_weights(model, spec.request.lora)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    world.same_start(params)
    optimizer = make_optimizer(params, t, device)
    run = Run(
        spec=spec,
        device=device,
        world=world,
        tokenizer=tokenizer,
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=p.warmup, num_training_steps=p.steps),
        scaler=torch.amp.GradScaler("cuda") if dtype == torch.float16 else None,
        autocast_dtype=dtype if device == "cuda" else torch.float32,
        pad_id=pad_id,
        train_set=train_set,
        eval_set=eval_set,
        batches=batches,
        eval_batches=eval_batches,
        plan=p,
        best=BestEval(
            t.early_stopping_patience,
            t.early_stopping_min_delta,
            keep=bool(eval_batches) if t.keep_best is None else t.keep_best,
            higher=t.method == "grpo",  # its evaluations are rewards
        ),
        prompts=sample_prompts(t.sample_prompts, tokenizer, eval_set, train_set),
        initial=initial,
        objective=objective_for(spec, tokenizer, device, dtype if device == "cuda" else torch.float32, initial),
    )
    if spec.resume_from:
        state = resume(TrainingState(model, optimizer, run.scheduler), Path(spec.resume_from))
        run.at = Position(state["step"], state.get("tokens", 0), state["epoch"], state["batch_in_epoch"])
        run.best.load(state["best"])
        run.resumed_from = run.at.step
    return run


def _tokenized(spec: TrainerSpec, tokenizer: PreTrainedTokenizerBase, world: World):
    """The job's examples: rank 0 tokenizes into the node's cache, the others read them from there."""
    if spec.request.train.method == "grpo":  # prompts to answer, read whole: nothing to tokenize ahead (one rank)
        prompts, held_out = job_prompts(spec, tokenizer)
        return _some(prompts), held_out
    if not world.main:
        world.barrier()
    train_set, eval_set = job_data(spec, tokenizer)
    if world.main:
        world.barrier()
    return _some(train_set), eval_set


def _some(train_set):
    if not len(train_set):
        raise JobError("no training examples are left after the eval split; lower train.eval_fraction")
    return train_set
