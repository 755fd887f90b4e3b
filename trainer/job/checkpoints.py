"""Saving what a run learnt: the adapter alone, or a checkpoint another node can go on from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.errors import JobError
from trainer.job.position import Position

if TYPE_CHECKING:
    from trainer.model import TrainedAdapter


def save_adapter(model: TrainedAdapter, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True, selected_adapters=["default"])  # not a dpo job's reference
    return out


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint is of: the model (its adapter is what is saved), its optimizer and its lr schedule."""

    model: TrainedAdapter
    optimizer: torch.optim.Optimizer
    scheduler: Any


def save_checkpoint(of: TrainingState, at: Position, out_dir: Path, best: dict | None = None) -> Path:
    """Adapter, optimizer, schedule, data position and the best evaluation so far: enough to go on from here on
    another node."""
    from safetensors.torch import save_file

    path = out_dir / "checkpoints" / f"step-{at.step}"
    save_adapter(of.model, path / "adapter")
    best = dict(best or {})
    if best.get("weights") is not None:
        save_file(best.pop("weights"), str(path / "best_adapter.safetensors"))
    torch.save(
        {
            "optimizer": of.optimizer.state_dict(),
            "scheduler": of.scheduler.state_dict(),
            "step": at.step,
            "epoch": at.epoch,
            "batch_in_epoch": at.batch_in_epoch,
            "tokens": at.tokens,
            "best": best,
        },
        path / "trainer_state.pt",
    )
    return path


def resume(
    into: TrainingState, checkpoint: Path, load: Callable[[dict[str, torch.Tensor]], None] | None = None
) -> dict:
    """Load a checkpoint written by save_checkpoint (tensors only: weights_only, never arbitrary pickles); `load`
    puts the adapter's weights (peft's names) into the model (default: peft's own, for a peft model)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state_file = checkpoint / "trainer_state.pt"
    if not state_file.is_file():
        raise JobError(f"checkpoint {checkpoint} has no trainer_state.pt; resubmit the job without resume")
    weights = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    load(weights) if load else set_peft_model_state_dict(into.model, weights)
    state = torch.load(state_file, weights_only=True)
    into.optimizer.load_state_dict(state["optimizer"])
    into.scheduler.load_state_dict(state["scheduler"])
    best = state.get("best") or {}
    if (checkpoint / "best_adapter.safetensors").is_file():
        best["weights"] = load_file(str(checkpoint / "best_adapter.safetensors"))
    state["best"] = best
    return state
