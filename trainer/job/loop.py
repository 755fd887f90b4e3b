"""The training loop, top to bottom: LoRA on the base model, its optimizer, a schedule, accumulation, events; grpo's
completions are sampled and graded at the top of each step."""

from __future__ import annotations

import math
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import msgspec
import torch

from schemas.events import (
    Checkpoint,
    Finished,
    PreferenceMetrics,
    Progress,
    ReinforcementMetrics,
    Samples,
    Started,
    TrainerSpec,
)
from schemas.training import MUTATING_INITS
from trainer.data import examples as data
from trainer.adapter_init import save_plain_lora
from trainer.job.checkpoints import TrainingState, save_checkpoint
from trainer.objectives.chunked_loss import DEFAULT_CHUNK_TOKENS
from trainer.job.distributed import World
from trainer.job.ending import AdapterOut, Ending, finish
from trainer.errors import JobError
from trainer.events import emit
from trainer.objectives.objective import Dpo, Grpo, Sft
from trainer.job.position import Position
from trainer.objectives.rft import Prompts
from trainer.samples import probe, samples_event
from trainer.job.setup import Run, prepare
from trainer import lease
from trainer.signals import Signals
from trainer.job.tensorboard_log import NoLog, TensorBoardLog
from trainer.job.trackers import RunLogs

if TYPE_CHECKING:
    from trainer.model import AdaptedLM


def peak_mib(device: str) -> float:
    """This process's peak memory: on CUDA what torch allocated; else its own peak resident set (VmHWM). Not
    ru_maxrss: Linux carries the parent's peak into a child across exec, so a trainer started by a large agent
    reported the agent's peak as its own."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: the best there is (KiB on Linux)


@torch.no_grad()
def evaluate(
    model: AdaptedLM,
    batches,
    device,
    autocast_dtype,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    world: World = World(),
    objective: Sft | Dpo | None = None,
) -> float | None:
    """The mean loss over the held-out batches (per target token, or per pair for dpo; each rank's share of
    them, added up)."""
    if not batches:
        return None
    objective = objective or Sft(autocast_dtype, chunk_tokens)
    model.eval()
    total, count = 0.0, 0
    for b in filter(None, batches):
        b = b.to(device)
        total, count = total + float(objective.loss(model, b)), count + objective.count(b)
    model.train()
    summed, counted = world.sum(total, count)
    return summed / max(counted, 1)


def agree(signals: Signals, world: World) -> bool:
    """Whether to end after this step, the same on every rank: a stop or pause asked of one rank is asked of all.
    Whether they agreed to pause is signals.agreed_pause. What each rank was asked is left as it is: a signal that
    came while they agreed (the agent signals every rank) is agreed on at the next step, not lost."""
    asked, pause = signals.asked, signals.pause
    if world.size > 1:
        ranks_asked, ranks_paused = world.sum(float(asked), float(pause))
        asked, pause = ranks_asked > 0, ranks_paused > 0
    signals.agreed_pause = pause
    return asked


def train(spec: TrainerSpec, signals: Signals | None = None) -> Finished:
    """Train the spec's job to its end, a stop, a pause or early stopping; publish events as it goes."""
    run = prepare(spec)
    t, world, at = spec.request.train, run.world, run.at
    signals = signals or Signals()
    board = open_board(run)

    def publish(event) -> None:
        emit(event)
        board.progress(event) if isinstance(event, Progress) else board.samples(event)

    def samples(base: bool = False) -> None:
        publish(
            samples_event(run.model, run.tokenizer, run.prompts, run.device, t.sample_max_tokens, at.step, base=base)
        )

    announce(run)
    if run.prompts and at.step == 0 and world.main:
        samples(base=True)  # what the base model answers, before any step
    start = started(run)
    window_loss, window_count = 0.0, 0
    evaluated, paused = None, None  # the latest eval loss (grpo: eval reward)
    early, ended = "", False
    while at.step < run.plan.steps and not ended:  # the ranks agree to end after a step: its checkpoint is taken there
        batches = epoch_batches(run, at.epoch)
        first_batch, at.batch_in_epoch = at.batch_in_epoch, 0  # a resumed run starts mid-epoch, where it stopped
        for first in range(first_batch, len(batches), t.grad_accum):
            lease.hold_while_lapsed()  # the agent cannot vouch for this attempt now: no step until it can
            micro = run.objective.rollout(run.model, batches[first : first + t.grad_accum], at.step)  # grpo: sampled
            step_loss, grad_norm, lr = optimizer_step(run, micro)
            at.step += 1
            window_loss, window_count = window_loss + step_loss, window_count + 1
            position = (at.epoch, min(first + t.grad_accum, len(batches)))  # where the next step starts

            last = agree(signals, world) or at.step >= run.plan.steps
            if run.eval_batches and ((t.eval_steps and at.step % t.eval_steps == 0) or last):
                evaluated, early, graded = evaluation(run, board)
                last = last or bool(early)
                if graded and world.main:
                    publish(graded)  # grpo: held-out answers with their scores
                elif run.prompts and world.main:
                    samples()
            if at.step % t.logging_steps == 0 or last:
                epoch = at.epoch + position[1] / len(batches)
                publish(progress(run, start, epoch, window_loss / window_count, lr, grad_norm, evaluated, early))
                window_loss, window_count = 0.0, 0
            paused = last and signals.agreed_pause  # as the ranks agreed it: a signal coming later is for no step
            if world.main and ((t.save_steps and at.step % t.save_steps == 0 and not last) or paused):
                checkpoint(run, board, position)
            if last:
                ended = True
                break
        else:
            at.epoch += 1
    if run.prompts and not run.eval_batches and world.main:  # what the adapter answers at the end
        samples()
    board.close()
    finished = save_the_end(run, signals.agreed_pause if paused is None else paused, early)
    world.close()
    return finished


def epoch_batches(run: Run, epoch: int) -> data.EpochBatches:
    """This rank's batches of an epoch (the first epoch's were made when the run was prepared)."""
    if epoch == 0:
        return run.batches
    return data.make_batches(run.train_set, run.spec.request.train, run.pad_id, epoch, run.world.rank, run.world.size)


def started(run: Run) -> float:
    """The first step is about to be taken: peak memory counts from here; the monotonic time now."""
    if run.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return time.monotonic()


def open_board(run: Run):
    """Where rank 0 logs the run for TensorBoard (carried on from a resumed run's); the other ranks log nothing."""
    if not run.world.main:
        return NoLog()
    resumed = Path(run.spec.resume_from) if run.spec.resume_from else None
    return RunLogs(TensorBoardLog(run.out_dir / "tensorboard", carried_from=resumed), run.spec, run.out_dir)


def progress(
    run: Run, start: float, epoch: float, loss: float, lr: float, grad_norm: float, evaluated: float | None, early: str
) -> Progress:
    """The progress event after this step: the loss since the last one, speed, time left, memory, and the
    method's own figures (dpo's preferences, grpo's rewards)."""
    at, elapsed = run.at, time.monotonic() - start
    figures, rewarded = run.objective.metrics(run.world), isinstance(run.objective, Grpo)
    return Progress(
        step=at.step,
        steps=run.plan.steps,
        epoch=epoch,
        loss=loss,
        lr=lr,
        grad_norm=grad_norm,
        tokens=at.tokens,
        tokens_per_s=at.tokens / elapsed if elapsed > 0 else None,
        elapsed_s=elapsed,
        eta_s=elapsed / at.step * (run.plan.steps - at.step),
        peak_mib=peak_mib(run.device),
        eval_loss=None if rewarded else evaluated,
        eval_reward=evaluated if rewarded else None,
        message=early,
        preference=figures if isinstance(figures, PreferenceMetrics) else None,
        reinforcement=figures if isinstance(figures, ReinforcementMetrics) else None,
    )


def checkpoint(run: Run, board, position: tuple[int, int]) -> None:
    """Save a checkpoint to resume from at `position` (epoch, next batch), and tell the agent to ship it."""
    at = run.at
    where = Position(step=at.step, tokens=at.tokens, epoch=position[0], batch_in_epoch=position[1])
    path = save_checkpoint(TrainingState(run.model, run.optimizer, run.scheduler), where, run.out_dir, run.best.state())
    board.copy_into(path)
    emit(Checkpoint(step=at.step, path=str(path)))


def save_the_end(run: Run, paused: bool, early: str) -> Finished:
    """Save the adapter (or, paused, the state to resume from) and say how the run ended, with the probe engines
    serving this adapter must answer."""
    finished = finish(
        run.model,
        run.best,
        Ending(run.at.step, run.plan.steps, paused, early),
        AdapterOut(
            run.out_dir,
            write=lambda m, out: save_plain_lora(m, out, run.initial, run.spec.request.lora),
            save=run.world.main,
        ),
    )
    if run.world.main and finished.state != "paused":
        plain = run.spec.request.lora.init not in MUTATING_INITS  # pissa, loftq: the trainer's base is not the engine's
        finished = msgspec.structs.replace(finished, probe=probe(run.model, run.tokenizer, run.device, base=plain))
    return finished


def evaluation(run: Run, board) -> tuple[float, str, Samples | None]:
    """The eval loss now (grpo: the held-out prompts' mean reward, and a few of its answers, scored), kept if it
    is the best so far; and why to stop early ("": go on)."""
    t, step, graded = run.spec.request.train, run.at.step, None
    if isinstance(run.objective, Grpo):
        prompts = cast("list[Prompts]", run.eval_batches)  # grpo's batches are its prompts
        value, graded = run.objective.evaluate(run.model, prompts, step)
    else:
        loss = evaluate(
            run.model, run.eval_batches, run.device, run.autocast_dtype, t.loss_chunk_tokens, run.world, run.objective
        )
        assert loss is not None, "evaluation is asked only where the run has held-out batches"
        value = loss
    run.best.observe(step, value, run.model)
    board.evaluation(step, value, "reward" if run.best.higher else "loss")
    return value, run.best.why_stopped(t.early_stopping_min_delta) if run.best.should_stop else "", graded


def announce(run: Run) -> None:
    """The Started event: how many steps, on what, from where."""
    world = run.world
    on = f"{world.size} x {run.device}" if world.size > 1 else run.device
    resumed = f", resumed from step {run.resumed_from}" if run.resumed_from is not None else ""
    emit(
        Started(
            steps=run.plan.steps,
            examples=len(run.train_set),
            eval_examples=len(run.eval_set),
            device=on,
            message=f"training {run.plan.steps} steps on {on} ({len(run.train_set)} examples, "
            f"{len(run.batches)} batches/epoch){resumed}",
        )
    )


def optimizer_step(run: Run, micro_batches: list) -> tuple[float, float, float]:
    """One optimizer step over its micro-batches (accumulated; on every rank, gradients summed across them):
    returns the step's loss (the mean over every target token, or pair), the gradient norm, and the lr."""
    t, world = run.spec.request.train, run.world
    group = [b.to(run.device) for b in micro_batches if b is not None]
    (n_targets,) = world.sum(sum(run.objective.count(b) for b in group))
    step_loss, step_tokens = 0.0, 0
    for b in group:
        loss = run.objective.loss(run.model, b) / max(n_targets, 1)
        (run.scaler.scale(loss) if run.scaler else loss).backward()
        step_loss += float(loss.detach())
        step_tokens += b.tokens
    step_loss, all_tokens = world.sum(step_loss, step_tokens)
    run.at.tokens += int(all_tokens)
    world.sum_grads(run.params)
    if not math.isfinite(step_loss):
        raise JobError(
            f"the loss became {step_loss} at step {run.at.step + 1}; lower train.learning_rate "
            f"(now {t.learning_rate}) or check the data"
        )
    if run.scaler:
        run.scaler.unscale_(run.optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, t.max_grad_norm or float("inf")))
    lr = run.scheduler.get_last_lr()[0]
    if run.scaler:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm, lr
