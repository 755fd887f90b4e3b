"""Watching the evaluations (the eval loss, or grpo's eval reward, higher being better): the best adapter so far
(kept in memory), and when to stop because it stopped improving."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.model import TrainedAdapter


def adapter_weights(model: TrainedAdapter) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) weights, copied to CPU."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


@dataclass
class BestEval:
    patience: int = 0  # evaluations without improvement before stopping; 0: never stop early
    min_delta: float = 0.0
    keep: bool = False  # keep the best adapter's weights, to end with them
    higher: bool = False  # the evaluations are rewards: higher is better
    loss: float | None = None  # the best evaluation (a loss, or with `higher` a reward)
    step: int | None = None
    since: int = 0  # evaluations since the best
    weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def observe(self, step: int, value: float, model: TrainedAdapter) -> None:
        if self.loss is None or self._better(value, self.loss):
            self.loss, self.step, self.since = value, step, 0
            if self.keep:
                self.weights = adapter_weights(model)
        else:
            self.since += 1

    def _better(self, value: float, best: float) -> bool:
        return value > best + self.min_delta if self.higher else value < best - self.min_delta

    @property
    def should_stop(self) -> bool:
        return bool(self.patience) and self.since >= self.patience

    @property
    def metric(self) -> str:
        return "eval reward" if self.higher else "eval loss"

    def why_stopped(self, min_delta: float) -> str:
        return (
            f"stopped early: the {self.metric} did not improve by more than {min_delta:g} for {self.since} "
            f"evaluations (best {self.loss:.4f} at step {self.step})"
        )

    def restore(self, model: TrainedAdapter) -> bool:
        """Put the best adapter's weights back into the model; False when there are none to put back."""
        if not self.keep or self.weights is None:
            return False
        named = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in self.weights.items():
                named[name].copy_(value)
        return True

    def state(self) -> dict:
        """For a checkpoint (the weights separately, as safetensors)."""
        return {"loss": self.loss, "step": self.step, "since": self.since, "weights": self.weights}

    def load(self, state: dict) -> None:
        self.loss, self.step, self.since = state.get("loss"), state.get("step"), state.get("since", 0)
        self.weights = state.get("weights")
