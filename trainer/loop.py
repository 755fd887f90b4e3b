"""The training loop, top to bottom: LoRA on the base model, its optimizer, a schedule, accumulation, events."""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import set_seed
from peft import get_peft_model
from transformers import get_scheduler

from schemas.events import Checkpoint, Finished, Progress, Started, TrainerSpec
from trainer import data, model as base
from trainer.adapter_init import initial_weights, lora_config, save_plain_lora
from trainer.best import BestEval
from trainer.checkpoints import resume, save_adapter, save_checkpoint
from trainer.chunked_loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from trainer.distributed import World
from trainer.errors import JobError
from trainer.events import emit, mute
from trainer.optimizers import make_optimizer
from trainer.samples import sample_prompts, samples_event
from trainer.signals import Signals
from trainer.tensorboard_log import NoLog, TensorBoardLog
from trainer.trackers import RunLogs
from trainer.tokenize import job_data


def peak_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def batch_loss(model, batch: data.Batch, autocast_dtype,
               chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the batch's target tokens, and how many there were. With chunk_tokens, through
    the output projection a chunk at a time (same loss, same gradients, a fraction of the peak memory)."""
    head = output_head(model) if chunk_tokens else None
    inputs = dict(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask,
                  use_cache=False)
    targets = batch.targets.reshape(-1)
    with torch.autocast(device_type=batch.input_ids.device.type, dtype=autocast_dtype,
                        enabled=autocast_dtype != torch.float32):
        out = head.decoder(**inputs).last_hidden_state if head else model(**inputs).logits
    if head:
        loss = chunked_cross_entropy(out.reshape(-1, out.shape[-1]), head.weight, targets, chunk_tokens, head.scale)
    else:
        loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), targets,
                                                 ignore_index=data.IGNORE, reduction="sum")
    return loss, int((targets != data.IGNORE).sum())


@dataclass
class OutputHead:
    decoder: torch.nn.Module  # the model up to its last hidden state
    weight: torch.Tensor  # the output projection, [vocab, hidden]
    scale: float  # logits are divided by it (Granite's logits_scaling)


def output_head(model) -> OutputHead | None:
    """The decoder and the plain linear output projection of a causal LM (peft-wrapped or not); None when the
    logits are more than a linear projection (a bias, soft-capping, a multiplier), and the plain loss is used."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head, config = lm.get_output_embeddings(), lm.config
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) is not None:
        return None
    return OutputHead(lm.get_decoder(), head.weight, float(getattr(config, "logits_scaling", 1.0) or 1.0))


@torch.no_grad()
def evaluate(model, batches, device, autocast_dtype, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
             world: World = World()) -> float | None:
    """The mean loss per target token over the held-out batches (each rank's share of them, added up)."""
    if not batches:
        return None
    model.eval()
    total, count = 0.0, 0
    for b in filter(None, batches):
        loss, n = batch_loss(model, b.to(device), autocast_dtype, chunk_tokens)
        total, count = total + float(loss), count + n
    model.train()
    total, count = world.sum(total, count)
    return total / max(count, 1)


def lora_model(model, spec: TrainerSpec, device: str = "cpu"):
    lo = spec.request.lora
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in lo.target_modules if t not in present]
    if missing:
        raise JobError(f"lora.target_modules {missing} are not linear layers of this model; it has {sorted(present)}")
    return get_peft_model(model, lora_config(lo, device))


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


def agree(signals: Signals, world: World) -> bool:
    """Whether to end after this step, the same on every rank: a stop or pause asked of one rank is asked of all."""
    if world.size > 1:
        asked, pause = world.sum(float(signals.asked), float(signals.pause))
        signals.asked, signals.pause = asked > 0, pause > 0
    return signals.asked


def train(spec: TrainerSpec, signals: Signals | None = None) -> Finished:
    t = spec.request.train
    device = spec.device if spec.device == "cpu" or torch.cuda.is_available() else "cpu"
    world = World.from_env(device)
    if not world.main:
        mute()
    set_seed(t.seed)
    dtype = base.pick_dtype(t.precision, device)
    tokenizer, model = base.load(spec.request.base_dir, device, dtype, spec.request.quantization)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    if not world.main:  # rank 0 tokenizes into the node's cache; the others read it from there
        world.barrier()
    train_set, eval_set = job_data(spec, tokenizer)
    if world.main:
        world.barrier()
    if not len(train_set):
        raise JobError("no training examples are left after the eval split; lower train.eval_fraction")
    eval_batches = data.make_batches(eval_set, t, pad_id, 0, world.rank, world.size)
    batches = data.make_batches(train_set, t, pad_id, 0, world.rank, world.size)
    p = plan(len(batches), t)

    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = lora_model(model, spec, device)
    initial = initial_weights(model, spec.request.lora)  # pissa, loftq: saved as a plain LoRA of the original base
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    world.same_start(params)
    optimizer = make_optimizer(params, t, device)
    scheduler = get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=p.warmup, num_training_steps=p.steps)
    autocast_dtype = dtype if device == "cuda" else torch.float32
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    out_dir = Path(spec.out_dir)
    signals = signals or Signals()
    best = BestEval(t.early_stopping_patience, t.early_stopping_min_delta,
                    keep=bool(eval_batches) if t.keep_best is None else t.keep_best)
    prompts = sample_prompts(t.sample_prompts, tokenizer, eval_set, train_set)

    def publish(event) -> None:
        emit(event)
        board.progress(event) if isinstance(event, Progress) else board.samples(event)

    step, tokens, epoch, skip = 0, 0, 0, 0
    resumed = ""
    if spec.resume_from:
        state = resume(model, optimizer, scheduler, Path(spec.resume_from))
        step, tokens, epoch, skip = state["step"], state.get("tokens", 0), state["epoch"], state["batch_in_epoch"]
        best.load(state["best"])
        resumed = f", resumed from step {step}"
    board = (RunLogs(TensorBoardLog(out_dir / "tensorboard", carried_from=Path(spec.resume_from) if spec.resume_from
                                    else None), spec, out_dir) if world.main else NoLog())
    on = f"{world.size} x {device}" if world.size > 1 else device
    emit(Started(steps=p.steps, examples=len(train_set), eval_examples=len(eval_set), device=on,
                 message=f"training {p.steps} steps on {on} ({len(train_set)} examples, "
                         f"{len(batches)} batches/epoch){resumed}"))
    if prompts and step == 0 and world.main:
        publish(samples_event(model, tokenizer, prompts, device, t.sample_max_tokens, step, base=True))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.monotonic()
    window_loss, window_count = 0.0, 0
    eval_loss, paused = None, None
    early = ""
    while step < p.steps and not agree(signals, world) and not early:
        if epoch > 0:
            batches = data.make_batches(train_set, t, pad_id, epoch, world.rank, world.size)
        first_batch, skip = skip, 0  # a resumed run starts mid-epoch, where its checkpoint was
        for first in range(first_batch, len(batches), t.grad_accum):
            group = [b.to(device) for b in batches[first:first + t.grad_accum] if b is not None]
            n_targets, = world.sum(sum(int((b.targets != data.IGNORE).sum()) for b in group))
            step_loss, step_tokens = 0.0, 0
            for b in group:  # accumulate: the mean over every target token of the step, on every rank
                loss, _ = batch_loss(model, b, autocast_dtype, t.loss_chunk_tokens)
                loss = loss / max(n_targets, 1)
                (scaler.scale(loss) if scaler else loss).backward()
                step_loss += float(loss.detach())
                step_tokens += b.tokens
            step_loss, step_tokens = world.sum(step_loss, step_tokens)
            tokens += int(step_tokens)
            world.sum_grads(params)
            if not math.isfinite(step_loss):
                raise JobError(f"the loss became {step_loss} at step {step + 1}; lower train.learning_rate "
                               f"(now {t.learning_rate}) or check the data")
            if scaler:
                scaler.unscale_(optimizer)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or float("inf")))
            lr = scheduler.get_last_lr()[0]
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_loss, window_count = window_loss + step_loss, window_count + 1
            position = (epoch, min(first + t.grad_accum, len(batches)))  # where the next step starts

            last = agree(signals, world) or step >= p.steps
            evaluating = eval_batches and ((t.eval_steps and step % t.eval_steps == 0) or last)
            if evaluating:
                eval_loss = evaluate(model, eval_batches, device, autocast_dtype, t.loss_chunk_tokens, world)
                best.observe(step, eval_loss, model)
                board.evaluation(step, eval_loss)
                if best.should_stop:
                    early, last = best.why_stopped(t.early_stopping_min_delta), True
                if prompts and world.main:
                    publish(samples_event(model, tokenizer, prompts, device, t.sample_max_tokens, step))
            if step % t.logging_steps == 0 or last:
                elapsed = time.monotonic() - start
                publish(Progress(step=step, steps=p.steps, epoch=epoch + position[1] / len(batches),
                                 loss=window_loss / window_count, lr=lr, grad_norm=grad_norm, tokens=tokens,
                                 tokens_per_s=tokens / elapsed if elapsed > 0 else None, elapsed_s=elapsed,
                                 eta_s=elapsed / step * (p.steps - step), peak_mib=peak_mib(device),
                                 eval_loss=eval_loss, message=early))
                window_loss, window_count = 0.0, 0
            paused = last and signals.pause  # as the ranks agreed it: a signal coming later is for no step
            if world.main and ((t.save_steps and step % t.save_steps == 0 and not last) or paused):
                path = save_checkpoint(model, optimizer, scheduler, out_dir, step, *position, tokens, best.state())
                board.copy_into(path)
                emit(Checkpoint(step=step, path=str(path)))
            if last:
                break
        else:
            epoch += 1
    if prompts and not eval_batches and world.main:  # what the adapter answers at the end (evaluations did already)
        publish(samples_event(model, tokenizer, prompts, device, t.sample_max_tokens, step))
    board.close()
    paused = signals.pause if paused is None else paused
    finished = finish(model, out_dir, step, p.steps, paused, best, early, save=world.main,
                      as_lora=lambda m, out: save_plain_lora(m, out, initial, spec.request.lora))
    world.close()
    return finished


def finish(model, out_dir: Path, step: int, steps: int, paused: bool, best: BestEval, early: str,
           save: bool = True, as_lora=save_adapter) -> Finished:
    """The run's end: paused (its checkpoint is the adapter), stopped, or trained, with the best adapter kept."""
    if paused:
        checkpoint = out_dir / "checkpoints" / f"step-{step}"
        return Finished(state="paused", step=step, adapter_dir=str(checkpoint / "adapter"),
                        message=f"paused at step {step} of {steps}; resume goes on from there")
    kept = best.restore(model)
    adapter = as_lora(model, out_dir / "adapter") if save else out_dir / "adapter"
    stopped = step < steps and not early
    message = f"stopped at step {step} of {steps} and saved" if stopped else early or f"trained {step} steps"
    if kept:
        message += f"; the adapter is step {best.step}'s, the best eval loss ({best.loss:.4f})"
    return Finished(state="stopped" if stopped else "trained", step=step, adapter_dir=str(adapter), message=message,
                    best_step=best.step if kept else None, best_eval_loss=best.loss if kept else None)
