"""OpenAI's reinforcement method as jetlora's grpo: its hyperparameters mapped (the README's table), its grader
checked naming each error's path as the client sent it, and the job's progress shown as OpenAI's RFT metrics
events show it (train_mean_reward, full_valid_mean_reward, scores per grader, errors)."""

from __future__ import annotations

from typing import Any

from schemas.events import Progress, ReinforcementMetrics
from schemas.gateway import CreateJob, ReinforcementHyperparameters, ReinforcementSettings
from schemas.graders import Grader
from schemas.training import TrainConfig
from services.gateway.errors import bad_request
from services.graders import check
from services.graders.decode import decode_grader

WHERE = "method.reinforcement"
GROUP_PER_MULTIPLIER = 4  # compute_multiplier 1 samples grpo's default group: 4 completions per prompt
GROUP_MIN, GROUP_MAX = 2, 256  # a group of one has nothing to be compared with
REASONING_TAKEN = (None, "default", "auto")


def group_size(multiplier: float | str) -> int:
    """Completions sampled per prompt: round(4 x compute_multiplier) within [2, 256]; auto: grpo's default (4)."""
    if multiplier == "auto":
        return TrainConfig().group_size
    assert isinstance(multiplier, (int, float))
    return max(GROUP_MIN, min(GROUP_MAX, round(GROUP_PER_MULTIPLIER * multiplier)))


def reinforcement_settings(req: CreateJob) -> tuple[ReinforcementSettings, Grader]:
    """The request's reinforcement settings and grader, checked: a 400 naming the field that is wrong."""
    settings = req.method.reinforcement if req.method else None
    if settings is None:
        raise bad_request(
            f"{WHERE}: a reinforcement job needs its grader (and may set hyperparameters): send "
            f'method={{"type": "reinforcement", "reinforcement": {{"grader": {{...}}}}}}',
            WHERE,
        )
    hp, field = settings.hyperparameters, f"{WHERE}.hyperparameters"
    if hp.reasoning_effort not in REASONING_TAKEN:
        raise bad_request(
            f"{field}.reasoning_effort: {hp.reasoning_effort!r} sets how long a reasoning model thinks, and this "
            "fleet's models do not reason, so no effort can be honoured; drop it or send 'default'",
            f"{field}.reasoning_effort",
        )
    if hp.eval_interval != "auto" and req.validation_file is None:
        raise bad_request(
            f"{field}.eval_interval: evaluation grades samples of held-out prompts; give a validation_file (an rft "
            "file) or leave eval_interval auto",
            f"{field}.eval_interval",
        )
    grader, errors = decode_grader(settings.grader, f"{WHERE}.grader")
    if grader is not None:
        errors = check(grader, f"{WHERE}.grader")  # whether it can run is the nodes' to say: see `jetlora agent`
    if errors or grader is None:
        message = "; ".join(f"{e.field}: {e.reason}" for e in errors)
        raise bad_request(message, errors[0].field if errors else f"{WHERE}.grader", "invalid_grader")
    return settings, grader


def grpo_settings(train: TrainConfig, hp: ReinforcementHyperparameters, grader: Grader, eval_every: int) -> None:
    """Make `train` (the common hyperparameters already in) grpo's: the grader, the group, the evaluations
    (every eval_interval steps, or `eval_every` on auto: the checkpoints' interval where there is held-out data)."""
    train.method, train.grader = "grpo", grader
    train.group_size = group_size(hp.compute_multiplier)
    if hp.eval_samples != "auto":
        train.eval_samples = hp.eval_samples
    train.eval_steps = hp.eval_interval if hp.eval_interval != "auto" else eval_every


def shown_reinforcement(hp: ReinforcementHyperparameters, train: TrainConfig) -> dict[str, Any]:
    """The values the job runs with, as OpenAI names them (eval_interval 0: no evaluation, no validation_file)."""
    multiplier = hp.compute_multiplier if hp.compute_multiplier != "auto" else train.group_size / GROUP_PER_MULTIPLIER
    return {
        "compute_multiplier": multiplier,
        "eval_interval": train.eval_steps,
        "eval_samples": train.eval_samples,
        "reasoning_effort": "default",
    }


def reinforcement_event(e: Progress, r: ReinforcementMetrics) -> tuple[str, dict[str, Any]]:
    """A grpo step's message and data, in the names of OpenAI's RFT metrics events, jetlora's figures beside."""
    valid = e.eval_reward
    graders = [{"name": name, "train_reward_mean": s.mean, "train_reward_std": s.std} for name, s in r.graders.items()]
    data: dict[str, Any] = {
        "step": e.step,
        "total_steps": e.steps,
        "train_mean_reward": r.reward,
        "full_valid_mean_reward": valid,
        "scores": {"train_reward_mean": r.reward, "valid_reward_mean": valid, "graders": graders},
        "errors": {"train_other_error_count": r.grading_failures},
        "completion_tokens_mean": r.completion_tokens,
        "train_reward_std": r.reward_std,
        "train_pass_rate": r.pass_rate,
        "kl": r.kl,
        "rollouts_per_s": r.rollouts_per_s,
        "train_loss": e.loss,
        "learning_rate": e.lr,
        "tokens": e.tokens,
    }
    text = f"Step {e.step}/{e.steps}, train mean reward={r.reward:.2f}, pass rate={r.pass_rate:.2f}"
    if valid is not None:
        text += f", full validation mean reward={valid:.2f}"
    if r.grading_failures:
        text += f", grading failures={r.grading_failures}"
    return text, data
