"""Gated canaries: `adapters promote NAME@V --gate EVAL --canary N`. Once the gate has passed on the trainer's side
(schemas/gates.py), the name moves on the canary nodes first, and each of them runs the gate's eval through its own
engine, under the served name: the items the candidate's trainer-side run answered, sampled as that run sampled them,
graded by the eval's graders. The canary carries what they need (`ServedEval`: the run's results artifact, the
graders, the sampling, the trainer-side score and its 95% interval); each node reports its served score with its
status (`ServedScore`). The registry finishes the canary only when every canary node loaded the version, its parity
is not beyond bounds and its served score lies within the trainer-side interval widened by `tolerance` on each side
(an engine at another precision may answer a few items otherwise); anything else rolls it back, with the figures.

The score is the gate's: the mean over items of the eval's item score (`schemas.gates.item_score`)."""

from __future__ import annotations

from msgspec import Struct, field

from schemas.evals import Criterion, Sampling

TOLERANCE = 0.05  # the trainer-side interval is widened by this much on each side for the served score
EVAL_SHARE = 0.8  # of the canary's deadline, the share a node has to evaluate (it fails saying so past it)
REQUEST_TIMEOUT_S = 60.0  # one completion through the engine
CONCURRENCY = 8  # completions a node asks its engine for at once


class ServedEval(Struct, kw_only=True):
    """The eval a gated canary's nodes run through their engines, and the trainer-side score it must match."""

    eval: str
    run: str  # the candidate's trainer-side run: its items (and its outputs) are what the nodes answer
    results: str  # the object-store name of that run's `eval` artifact (ItemResult lines, then the summary)
    sha256: str
    criteria: list[Criterion]
    sampling: Sampling
    items: int
    mean: float  # the trainer-side score
    low: float  # its 95% bootstrap interval
    high: float
    graders: dict[str, float] = field(default_factory=dict)  # each grader's trainer-side mean
    tolerance: float = TOLERANCE
    deadline_s: float = 480.0  # a node's own budget to evaluate, from its start (EVAL_SHARE of the canary's)
    request_timeout_s: float = REQUEST_TIMEOUT_S


class ServedScore(Struct, kw_only=True):
    """What one canary node's engine scored on the eval, under the served name (reported with its status)."""

    eval: str
    run: str  # the trainer-side run whose items it answered
    items: int
    samples: int
    mean: float  # the eval's score, as ServedEval.mean is the trainer's
    graders: dict[str, float] = field(default_factory=dict)  # each grader's mean
    errored: int = 0  # items a grader failed on (scored 0)
    agree: int = 0  # items whose completions are the trainer's, word for word
    seconds: float = 0.0
    example: str = ""  # the first item the engine scored below the trainer, for people


def bounds(e: ServedEval) -> tuple[float, float]:
    """Where a served score must lie: the trainer-side interval, widened by the tolerance on each side."""
    return e.low - e.tolerance, e.high + e.tolerance


def counts(e: ServedEval, s: ServedScore | None) -> bool:
    """Whether a node's served score is of this canary's eval (the same run's items, all of them)."""
    return s is not None and s.eval == e.eval and s.run == e.run and s.items == e.items


def within(e: ServedEval, s: ServedScore) -> bool:
    low, high = bounds(e)
    return low <= s.mean <= high


def trainer_side(e: ServedEval) -> str:
    """The trainer-side figures, for people: `trainer 1.000 [0.875, 1.000] +/- 0.05 on 16 items`."""
    return f"trainer {e.mean:.3f} [{e.low:.3f}, {e.high:.3f}] +/- {e.tolerance:g} on {e.items} items"


def describe(e: ServedEval | None, s: ServedScore) -> str:
    """One line for people: the served score, its graders, and (where the canary's eval is known) against the
    trainer's."""
    parts = [f"{name} {mean:.3f}" for name, mean in sorted(s.graders.items())]
    parts += [f"{s.agree} answered as the trainer"] + [f"{s.errored} with grader errors"] * bool(s.errored)
    said = f"served eval {s.eval} {s.mean:.3f} over {s.items} items ({'; '.join(parts)}; {s.seconds:.1f}s)"
    if e is not None and counts(e, s):
        said += f" against {trainer_side(e)}: " + ("within" if within(e, s) else "OUTSIDE")
    return said + (f"; e.g. {s.example}" if s.example else "")
