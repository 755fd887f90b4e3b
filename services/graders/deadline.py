"""How long grading may take: a deadline fixed when a call (or a whole request) starts, which nothing a grader does
moves, with the limit it stands for in words, so that an error can name it."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    at: float  # time.monotonic()
    what: str  # the limit, as an error names it: "this request's 60 s of sandbox time (...)"

    @classmethod
    def after(cls, seconds: float, what: str) -> Deadline:
        return cls(time.monotonic() + seconds, what)

    def left(self) -> float:
        return self.at - time.monotonic()


def earliest(first: Deadline, *others: Deadline | None) -> Deadline:
    """The deadline that comes first (None: no deadline of that kind)."""
    return min((first, *(d for d in others if d is not None)), key=lambda d: d.at)
