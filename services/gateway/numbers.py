"""Numbers in a request body, refused where they are no number this API can keep: a float that is not finite
(1e400, which overflows; NaN and Infinity, which are not JSON) or an integer past 64 bits (which every store,
engine and trainer behind the gateway would overflow on). Each refusal names the number's field, so a client
learns which value to fix, never a bare "not valid JSON" or a 500."""

from __future__ import annotations

import json
import math
from typing import Any

INT_MAX = 2**63 - 1
DEPTH_MAX = 200  # deeper than any request of this API nests; msgspec refuses far deeper ones on its own


def unfit(value: Any, field: str = "") -> tuple[str, str] | None:
    """The first number in a decoded JSON value that is out of range: (its field, why); None when all fit."""
    stack: list[tuple[Any, str, int]] = [(value, field, 0)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, bool):
            continue
        if isinstance(node, int) and not -INT_MAX - 1 <= node <= INT_MAX:
            return where, f"{_shown(node)} is past 64 bits; give an integer within ±9.2e18"
        if isinstance(node, float) and not math.isfinite(node):
            said = "is NaN" if math.isnan(node) else f"overflows to {'-' if node < 0 else ''}infinity"
            return where, f"the number {said}; give a finite number"
        if depth >= DEPTH_MAX:
            continue
        if isinstance(node, dict):
            stack += [(v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in reversed(node.items())]
        elif isinstance(node, list):
            stack += [(v, f"{where}[{n}]", depth + 1) for n, v in reversed(list(enumerate(node)))]
    return None


def _shown(n: int) -> str:
    text = str(n) if abs(n) < 10**40 else f"{'-' if n < 0 else ''}1e{len(str(abs(n))) - 1}"
    return text


def locate(data: bytes) -> tuple[str, str] | None:
    """Where a body that msgspec would not read for its numbers (1e400, NaN, Infinity) has the first of them, as
    Python's own reader finds it; None when it is unreadable for another reason (then it is simply not JSON)."""

    def constant(name: str) -> float:
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]

    try:
        value = json.loads(data, parse_constant=constant)
    except (ValueError, RecursionError):
        return None
    return unfit(value)
