"""The training loop, top to bottom: LoRA on the base model, AdamW, a schedule, accumulation, events."""

from __future__ import annotations

import math
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model
from transformers import get_scheduler

from schemas.events import Checkpoint, Finished, Progress, Started, TrainerSpec
from trainer import data, model as base
from trainer.chunked_loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from trainer.errors import JobError
from trainer.events import emit
from trainer.tokenize import job_data


class StopFlag:
    """SIGUSR1 from the agent: save what was learnt and end as `stopped`."""

    def __init__(self) -> None:
        self.asked = False
        signal.signal(signal.SIGUSR1, self._ask)

    def _ask(self, *_):
        self.asked = True


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
def evaluate(model, batches, device, autocast_dtype, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> float | None:
    if not batches:
        return None
    model.eval()
    total, count = 0.0, 0
    for b in batches:
        loss, n = batch_loss(model, b.to(device), autocast_dtype, chunk_tokens)
        total, count = total + float(loss), count + n
    model.train()
    return total / max(count, 1)


def lora_model(model, spec: TrainerSpec):
    lo = spec.request.lora
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in lo.target_modules if t not in present]
    if missing:
        raise JobError(f"lora.target_modules {missing} are not linear layers of this model; it has {sorted(present)}")
    cfg = LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout, target_modules=list(lo.target_modules),
                     use_rslora=lo.rslora, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


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


def save_adapter(model, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_checkpoint(model, optimizer, scheduler, out_dir: Path, step: int, epoch: int, batch_in_epoch: int,
                    tokens: int) -> Path:
    """Adapter, optimizer, schedule and data position: enough to go on from here on another node."""
    path = out_dir / "checkpoints" / f"step-{step}"
    save_adapter(model, path / "adapter")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step, "epoch": epoch,
                "batch_in_epoch": batch_in_epoch, "tokens": tokens}, path / "trainer_state.pt")
    return path


def resume(model, optimizer, scheduler, checkpoint: Path) -> dict:
    """Load a checkpoint written by save_checkpoint (tensors only: weights_only, never arbitrary pickles)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state_file = checkpoint / "trainer_state.pt"
    if not state_file.is_file():
        raise JobError(f"checkpoint {checkpoint} has no trainer_state.pt; resubmit the job without resume")
    set_peft_model_state_dict(model, load_file(str(checkpoint / "adapter" / "adapter_model.safetensors")))
    state = torch.load(state_file, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state


def train(spec: TrainerSpec) -> Finished:
    t = spec.request.train
    device = spec.device if spec.device == "cpu" or torch.cuda.is_available() else "cpu"
    set_seed(t.seed)
    dtype = base.pick_dtype(t.precision, device)
    tokenizer, model = base.load(spec.request.base_dir, device, dtype)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    train_set, eval_set = job_data(spec, tokenizer)
    if not train_set:
        raise JobError("no training examples are left after the eval split; lower train.eval_fraction")
    eval_batches = data.make_batches(eval_set, t, pad_id, epoch=0)
    batches = data.make_batches(train_set, t, pad_id, epoch=0)
    p = plan(len(batches), t)

    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = lora_model(model, spec)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    scheduler = get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=p.warmup, num_training_steps=p.steps)
    autocast_dtype = dtype if device == "cuda" else torch.float32
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    out_dir = Path(spec.out_dir)
    stop = StopFlag()

    step, tokens, epoch, skip = 0, 0, 0, 0
    resumed = ""
    if spec.resume_from:
        state = resume(model, optimizer, scheduler, Path(spec.resume_from))
        step, tokens, epoch, skip = state["step"], state.get("tokens", 0), state["epoch"], state["batch_in_epoch"]
        resumed = f", resumed from step {step}"
    emit(Started(steps=p.steps, examples=len(train_set), eval_examples=len(eval_set), device=device,
                 message=f"training {p.steps} steps on {device} ({len(train_set)} examples, "
                         f"{len(batches)} batches/epoch){resumed}"))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.monotonic()
    window_loss, window_count = 0.0, 0
    eval_loss = None
    while step < p.steps and not stop.asked:
        if epoch > 0:
            batches = data.make_batches(train_set, t, pad_id, epoch)
        first_batch, skip = skip, 0  # a resumed run starts mid-epoch, where its checkpoint was
        for first in range(first_batch, len(batches), t.grad_accum):
            group = [b.to(device) for b in batches[first:first + t.grad_accum]]
            n_targets = sum(int((b.targets != data.IGNORE).sum()) for b in group)
            step_loss = 0.0
            for b in group:  # accumulate: the mean over every target token of the step
                loss, _ = batch_loss(model, b, autocast_dtype, t.loss_chunk_tokens)
                loss = loss / max(n_targets, 1)
                (scaler.scale(loss) if scaler else loss).backward()
                step_loss += float(loss.detach())
                tokens += b.tokens
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

            if t.eval_steps and eval_batches and step % t.eval_steps == 0:
                eval_loss = evaluate(model, eval_batches, device, autocast_dtype, t.loss_chunk_tokens)
            if t.save_steps and step % t.save_steps == 0 and step < p.steps:
                path = save_checkpoint(model, optimizer, scheduler, out_dir, step, epoch, first + len(group), tokens)
                emit(Checkpoint(step=step, path=str(path)))
            last = step >= p.steps or stop.asked
            if last and eval_batches:
                eval_loss = evaluate(model, eval_batches, device, autocast_dtype, t.loss_chunk_tokens)
            if step % t.logging_steps == 0 or last:
                elapsed = time.monotonic() - start
                emit(Progress(step=step, steps=p.steps, epoch=epoch + (first + len(group)) / len(batches),
                              loss=window_loss / window_count, lr=lr, grad_norm=grad_norm, tokens=tokens,
                              tokens_per_s=tokens / elapsed if elapsed > 0 else None, elapsed_s=elapsed,
                              eta_s=elapsed / step * (p.steps - step), peak_mib=peak_mib(device), eval_loss=eval_loss))
                window_loss, window_count = 0.0, 0
            if last:
                break
        epoch += 1

    adapter = save_adapter(model, out_dir / "adapter")
    state = "stopped" if step < p.steps else "trained"
    message = f"stopped at step {step} of {p.steps} and saved" if state == "stopped" else f"trained {step} steps"
    return Finished(state=state, step=step, adapter_dir=str(adapter), message=message)
