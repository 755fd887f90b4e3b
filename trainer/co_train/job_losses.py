"""Each job's loss from the group's one forward: its rows of the shared output through the same loss a job alone
takes (trainer/objectives/losses.py's cross-entropy, trainer/objectives/dpo.py's preference loss), so the two cannot drift apart."""

from __future__ import annotations

import torch

from trainer.co_train.combine import Combined, combine
from trainer.multi_lora.layer import Routing
from trainer.multi_lora.shared_base import SharedBase
from trainer.objectives.dpo import logps_of, preference_loss
from trainer.objectives.losses import targets_loss
from trainer.objectives.objective import Dpo


@torch.no_grad()
def reference_outputs(base: SharedBase, micro: dict, dpo_jobs: list[str], pad_id: int) -> dict[str, torch.Tensor]:
    """The dpo jobs' rows through the base alone (their reference: no adapter), in one forward of their own."""
    if not dpo_jobs:
        return {}
    ref = combine({j: micro[j] for j in dpo_jobs}, pad_id, base.model)
    with base.routed(Routing()):
        out = base.output(ref.batch, ref.layout)
    return {j: ref.out_of(out, j) for j in ref.spans}


def job_loss(
    base: SharedBase, objective, out: torch.Tensor, combined: Combined, job: str, referenced: torch.Tensor | None
) -> torch.Tensor:
    """The job's summed loss (divided later by what its step's loss is averaged over) over its part of `out`."""
    own, targets = combined.out_of(out, job), combined.targets_of(job)
    if isinstance(objective, Dpo):
        assert referenced is not None, "a dpo job's reference output is computed before its loss (reference_outputs)"
        policy = logps_of(own, base.head, targets, objective.chunk_tokens)
        reference = logps_of(referenced, base.head, targets[:, : referenced.shape[1]], objective.chunk_tokens)
        loss, stats = preference_loss(policy, reference, objective.beta)
        objective.window.add(stats)
        return loss
    return targets_loss(own, base.head, targets.reshape(-1), objective.chunk_tokens)
