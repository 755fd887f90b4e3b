"""How a run ends: the adapter it keeps (the best one when kept, else the last), saved where it goes, and the
Finished event that says whether it was trained, stopped or paused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.events import Finished
from trainer.job.best import BestEval
from trainer.job.checkpoints import save_adapter

if TYPE_CHECKING:
    from trainer.model import TrainedAdapter


@dataclass(frozen=True)
class Ending:
    """Where and why a run stopped: at `step` of `steps`; paused (its checkpoint at that step is its adapter), or
    stopped early for the reason in `early` ("": neither)."""

    step: int
    steps: int
    paused: bool = False
    early: str = ""


@dataclass(frozen=True)
class AdapterOut:
    """Where a run's adapter goes, `out_dir`/adapter, and what writes it there (peft's layout by default); with
    `save` False nothing is written (a rank other than the first: rank 0 writes it) and the path is only named."""

    out_dir: Path
    write: Callable[[TrainedAdapter, Path], Path] = save_adapter
    save: bool = True


def finish(model: TrainedAdapter, best: BestEval, ending: Ending, out: AdapterOut) -> Finished:
    """The run's end: paused (its checkpoint is the adapter), stopped, or trained, with the best adapter kept."""
    step, steps, early = ending.step, ending.steps, ending.early
    if ending.paused:
        checkpoint = out.out_dir / "checkpoints" / f"step-{step}"
        return Finished(
            state="paused",
            step=step,
            adapter_dir=str(checkpoint / "adapter"),
            message=f"paused at step {step} of {steps}; resume goes on from there",
        )
    kept = best.restore(model)
    adapter = out.write(model, out.out_dir / "adapter") if out.save else out.out_dir / "adapter"
    stopped = step < steps and not early
    message = f"stopped at step {step} of {steps} and saved" if stopped else early or f"trained {step} steps"
    if kept:
        message += f"; the adapter is step {best.step}'s, the best {best.metric} ({best.loss:.4f})"
    return Finished(
        state="stopped" if stopped else "trained",
        step=step,
        adapter_dir=str(adapter),
        message=message,
        best_step=best.step if kept else None,
        best_eval_loss=best.loss if kept and not best.higher else None,
        best_eval_reward=best.loss if kept and best.higher else None,
    )
