"""Train/serve parity: a small fixed probe set whose per-token log-probabilities the trainer computes, teacher-forced,
with the trained adapter and with the base model alone, and stores with the adapter's probe (schemas/jobs.py Probe);
each engine that serves the adapter is asked for the same (services/agent/parity.py). Parity is how far the engine's
are from the trainer's with the adapter; the floor is the same with the base alone, the noise of the engine's
precision. A node whose parity's mean is above factor x the floor's mean + epsilon reports the version `mismatch`."""

from __future__ import annotations

from msgspec import Struct

PARITY_TEXTS = (  # short texts of a few kinds, 16-32 tokens each for a usual tokenizer
    "The capital of France is Paris, and the capital of Japan is Tokyo. Both are large and old cities.",
    "Question: Which planet is known as the red planet? Answer: Mars is known as the red planet.",
    "Counting on: one, two, three, five, eight, thirteen, 21, 34, 55 and 89 come next.",
    "She opened the window, looked at the rain for a while, and then went back to her book.",
)
PARITY_FACTOR = 3.0  # a node's parity mean may be this many times its floor's mean ...
PARITY_EPSILON = 0.01  # ... plus this (nats per token), where the floor is near 0 (an fp32 engine)


class ParityText(Struct, kw_only=True):
    """One probe-set text as the trainer scored it: the log-probability of each token after the first, given those
    before it, with the adapter and with the base model alone."""

    prompt: str  # what an engine that takes text is sent: the text, after the model's BOS written out where its
    # tokenizer adds none (an engine's echoed log-probabilities start at a BOS)
    ids: list[int]  # its tokens as the trainer's tokenizer made them; an engine that takes token ids is sent these
    bos: bool  # ids start with the model's BOS
    adapter: list[float]  # log p(ids[i] | ids[:i]) for i >= 1, with the adapter
    base: list[float] | None = None  # the same with the adapter off; None where the trainer changed the base
    # weights (pissa, loftq: its base is not the engine's)


class ParityFigures(Struct, kw_only=True):
    """How near an engine's per-token log-probabilities of the probe set are to its trainer's (|Δ log p|, nats)."""

    mean: float  # with the adapter: the engine serving it against the trainer's PEFT forward
    max: float
    tokens: int  # tokens compared
    floor_mean: float | None = None  # the base model alone, engine against trainer: the precision's noise
    floor_max: float | None = None
    limit: float | None = None  # factor x floor_mean + epsilon: a mean above it is a mismatch; None: not judged
    within: bool | None = None  # mean <= limit; None: not judged (no floor measured)
    note: str = ""  # what was left out, or why it was not judged


def deltas(trainer: list[float], engine: list[float | None]) -> list[float]:
    """|Δ log p| of each token both scored (an engine may leave some out, e.g. the first after a BOS)."""
    return [abs(a - b) for a, b in zip(trainer, engine) if b is not None]


def figures(adapter: list[float], floor: list[float] | None, factor: float, epsilon: float, note: str = ""):
    """The figures from the per-token differences with the adapter and (where measured) with the base alone."""
    if not adapter:
        return ParityFigures(mean=0.0, max=0.0, tokens=0, note=note or "no token compared")
    mean, top = sum(adapter) / len(adapter), max(adapter)
    if not floor:
        return ParityFigures(mean=mean, max=top, tokens=len(adapter), note=note or "no floor measured: not judged")
    floor_mean = sum(floor) / len(floor)
    limit = factor * floor_mean + epsilon
    return ParityFigures(
        mean=mean,
        max=top,
        tokens=len(adapter),
        floor_mean=floor_mean,
        floor_max=max(floor),
        limit=limit,
        within=mean <= limit,
        note=note,
    )


def describe(f: ParityFigures) -> str:
    """One line for people: parity, floor, limit."""
    said = f"parity: mean |Δ log p| {f.mean:.3g} (max {f.max:.3g}) over {f.tokens} tokens"
    if f.floor_mean is not None and f.floor_max is not None:
        said += f"; base alone {f.floor_mean:.3g} (max {f.floor_max:.3g}); limit {f.limit:.3g}"
    return said + (f" ({f.note})" if f.note else "")
