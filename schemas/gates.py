"""Gates: promote a version only when an eval says it beats the version served now.

The eval's score of an item is the mean over the eval's graders of that item's score, each grader's score of an item
being the mean over its samples (an eval with one grader: that grader's). A paired comparison of two completed runs
of one eval on the same items (the candidate's, the incumbent's) takes each item's difference (candidate -
incumbent), their mean, and the 95% percentile bootstrap interval of that mean (items resampled with replacement,
`RESAMPLES` times with the fixed `SEED`, so a decision is reproducible). A gate passes when the interval's lower end
is at least the margin. With no incumbent (a name's first version, or one retired) the gate compares against the base
model alone (no adapter): a first version must beat the base.

This module imports no other schema module but evals (and graders through it): schemas/jobs.py takes `GateSpec`."""

from __future__ import annotations

import math
import random
from typing import Annotated, Literal

from msgspec import Meta, Struct

from schemas.evals import ItemResult, Token

RESAMPLES, SEED = 2000, 0
DEADLINE_S = 1800.0


class GateSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """Promote only if the eval says the candidate beats what the name serves now (or, serving none, the base)."""

    eval: Annotated[Token, Meta(description="the eval (`jetlora evals ls`) that decides")]
    margin: Annotated[
        float, Meta(ge=-1, le=1, description="the 95% interval of (candidate - incumbent) must lie at or above this")
    ] = 0.0
    deadline_s: Annotated[
        float, Meta(gt=0, le=86400, description="the eval runs' time to end; past it the promote is refused")
    ] = DEADLINE_S
    base_dir: Annotated[str, Meta(description="where nodes hold the base model; none: the version's job's")] | None = (
        None
    )


class Comparison(Struct, kw_only=True):
    """Candidate against incumbent on one eval's items, paired by item."""

    eval: str
    candidate: str  # the models as runs name them: NAME@V, or the base model
    incumbent: str
    candidate_run: str
    incumbent_run: str
    items: int
    candidate_mean: float
    incumbent_mean: float
    diff: float  # mean of the per-item differences
    low: float  # its 95% paired bootstrap interval
    high: float
    resamples: int = RESAMPLES
    seed: int = SEED
    candidate_low: float | None = None  # the 95% bootstrap interval of the candidate's own score (what a gated
    candidate_high: float | None = None  # canary's served scores must lie within: schemas/served.py)


class CompareRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Compare two completed runs of one eval (jetlora.evals[.<tenant>].compare)."""

    candidate: Token  # a run id
    incumbent: Token


class CompareReply(Struct, tag="comparison", tag_field="type", kw_only=True):
    comparison: Comparison


GateState = Literal["evaluating"]


class Gate(Struct, kw_only=True):
    """A gated promote under way, kept in the alias: the registry starts the runs it lacks, waits for them (its own
    clock, to `deadline`) and decides; the outcome is the alias's `last_gate`."""

    eval: str
    margin: float
    version: int  # the candidate
    incumbent: int | None  # the version served when the gate began; None: the base model
    base_model: str
    base_dir: str
    accelerator: str = "any"
    candidate_run: str | None = None
    incumbent_run: str | None = None
    started: float = 0.0
    deadline: float = 0.0
    state: GateState = "evaluating"
    note: str = ""  # where it stands, for people
    canary: str | None = None  # passed, it starts a canary of this many nodes (N or N%) carrying the eval
    canary_deadline_s: float = 600.0  # that canary's nodes' time to load, verify and evaluate it


def item_score(r: ItemResult) -> float:
    """The eval's score of an item: the mean over its graders of each grader's mean over the item's samples."""
    per_grader = [sum(s) / len(s) for s in r.scores.values() if s]
    return sum(per_grader) / len(per_grader) if per_grader else 0.0


def paired_interval(diffs: list[float], resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the mean of paired differences."""
    if not diffs:
        return math.nan, math.nan
    rng, n = random.Random(seed), len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


class Unpaired(ValueError):
    """The runs were not made on the same items."""


def compare(candidate: list[ItemResult], incumbent: list[ItemResult], /, **names: str) -> Comparison:
    """The paired comparison of two runs' item results (names: eval, candidate, incumbent, candidate_run,
    incumbent_run); Unpaired if they are not on the same items."""
    mine = {r.index: r for r in candidate}
    theirs = {r.index: r for r in incumbent}
    if not mine or mine.keys() != theirs.keys() or any(mine[i].item != theirs[i].item for i in mine):
        raise Unpaired(
            f"runs {names.get('candidate_run')} and {names.get('incumbent_run')} were not made on the same items "
            "(another dataset, or it changed between them): run both again on the eval's dataset"
        )
    order = sorted(mine)
    a = [item_score(mine[i]) for i in order]
    b = [item_score(theirs[i]) for i in order]
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    low, high = paired_interval(diffs)
    own_low, own_high = paired_interval(a)  # the same resampling, of the candidate's item scores alone
    return Comparison(
        eval=names.get("eval", ""),
        candidate=names.get("candidate", ""),
        incumbent=names.get("incumbent", ""),
        candidate_run=names.get("candidate_run", ""),
        incumbent_run=names.get("incumbent_run", ""),
        items=len(order),
        candidate_mean=sum(a) / len(a),
        incumbent_mean=sum(b) / len(b),
        diff=sum(diffs) / len(diffs),
        low=low,
        high=high,
        candidate_low=own_low,
        candidate_high=own_high,
    )


def verdict(c: Comparison, margin: float) -> tuple[bool, str]:
    """(passed, why): passed when the interval's lower end is at least the margin; why carries the figures."""
    passed = c.low >= margin
    figures = (
        f"eval {c.eval} on {c.items} items: {c.candidate} {c.candidate_mean:.3f}, {c.incumbent} "
        f"{c.incumbent_mean:.3f}; difference {c.diff:+.3f}, 95% interval [{c.low:+.3f}, {c.high:+.3f}]"
    )
    if passed:
        return True, f"gate passed: {figures}, lower end >= margin {margin:+.3f}"
    return False, f"gate refused {c.candidate}: {figures}, lower end below margin {margin:+.3f}"


def unevaluated(model: str, role: str, why: str) -> str:
    """The refusal when a side could not be evaluated (its run failed: a corrupted file, an unloadable adapter)."""
    return f"gate refused: the {role} {model} could not be evaluated: {why}"
