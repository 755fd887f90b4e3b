"""A progress event as the named scalars TensorBoard, W&B and MLflow log: the loss and its schedule, speed and
memory, and grpo's rewards."""

from __future__ import annotations

METRICS = (
    ("train/loss", "loss"),
    ("train/learning_rate", "lr"),
    ("train/grad_norm", "grad_norm"),
    ("train/tokens_per_s", "tokens_per_s"),
    ("train/peak_mib", "peak_mib"),
    ("train/epoch", "epoch"),
)
REINFORCEMENT = (
    ("train/reward", "reward"),
    ("train/reward_std", "reward_std"),
    ("train/pass_rate", "pass_rate"),
    ("train/kl", "kl"),
    ("train/completion_tokens", "completion_tokens"),
    ("train/rollouts_per_s", "rollouts_per_s"),
    ("train/grading_failures", "grading_failures"),
)


def progress_metrics(p) -> dict[str, float]:
    out = {name: float(getattr(p, field)) for name, field in METRICS if getattr(p, field) is not None}
    if (r := p.reinforcement) is not None:
        out |= {name: float(getattr(r, field)) for name, field in REINFORCEMENT if getattr(r, field) is not None}
        out |= {f"train/reward/{grader}": stats.mean for grader, stats in r.graders.items()}
    return out
