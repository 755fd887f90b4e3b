"""Where a run stands between its steps: what the loop advances, a checkpoint records and a resumed run starts at."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Position:
    """Where the run stands: steps taken, tokens seen, and the batch of the epoch the next step starts at."""

    step: int = 0
    tokens: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
