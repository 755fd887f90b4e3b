"""A grpo job's figures over the completions graded since they were last reported: rewards (per grader, and per
named grader of a multi grader), how many pass, failures, lengths, speed and KL."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from schemas.events import ReinforcementMetrics, RewardStats
from trainer.objectives.rollouts import Rollout

PASS_WITHOUT_THRESHOLD = 0.5  # a score above it passes, for a grader that names no pass threshold


def passes(grader, score: float) -> bool:
    """At least the grader's pass_threshold where it has one, else above 0.5."""
    threshold = getattr(grader, "pass_threshold", None)
    return score >= threshold if threshold is not None else score > PASS_WITHOUT_THRESHOLD


@dataclass
class Sums:
    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, x: float) -> None:
        self.n, self.total, self.squares = self.n + 1, self.total + x, self.squares + x * x

    def stats(self) -> RewardStats:
        mean = self.total / self.n
        variance = (self.squares - self.n * mean * mean) / (self.n - 1) if self.n > 1 else 0.0
        return RewardStats(mean=mean, std=math.sqrt(max(variance, 0.0)))


@dataclass
class RewardWindow:
    """Sums over the completions graded since the last report."""

    grader: object
    rewards: Sums = field(default_factory=Sums)
    by_grader: dict[str, Sums] = field(default_factory=lambda: defaultdict(Sums))
    passed: int = 0
    failures: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    kl: float = 0.0  # summed over completion tokens

    def add(self, batch: Rollout) -> None:
        name = getattr(self.grader, "name", "grader")
        for result in batch.results:
            self.rewards.add(result.score)
            self.by_grader[name].add(result.score)
            for part, score in result.sub_scores.items():
                self.by_grader[part].add(score)
            self.passed += passes(self.grader, result.score)
            self.failures += bool(result.error)
        self.completion_tokens += int(batch.completion_mask.sum())
        self.seconds += batch.seconds

    def report(self, with_kl: bool) -> ReinforcementMetrics | None:
        """The window's figures (None: nothing was graded in it)."""
        n = self.rewards.n
        if not n:
            return None
        total = self.rewards.stats()
        return ReinforcementMetrics(
            reward=total.mean,
            reward_std=total.std,
            graders={name: sums.stats() for name, sums in self.by_grader.items()},
            pass_rate=self.passed / n,
            kl=self.kl / max(self.completion_tokens, 1) if with_kl else None,
            completion_tokens=self.completion_tokens / n,
            rollouts_per_s=n / self.seconds if self.seconds > 0 else 0.0,
            grading_failures=self.failures,
        )
