"""The agent's word that this attempt may go on computing (the file's format: schemas/trainer_lease.py).

The agent renews the lease each time a heartbeat of its reached the bus. Before each step the trainer checks it
and, once it has lapsed, waits: an agent that is frozen or cut off from the bus cannot tell the scheduler it still
runs this attempt, so the scheduler may be starting another one elsewhere, and two trainers of one job must not
both go on. When the agent is heard again it renews the lease (the trainer goes on) or ends this attempt."""

from __future__ import annotations

import os
import sys
import time

from schemas.trainer_lease import ENV, read

POLL_S = 0.05


def hold_while_lapsed(path: str | None = None) -> float:
    """Wait while the agent's lease has lapsed; the seconds waited (0.0 when it had not lapsed). Without a lease (run
    by hand), at once."""
    path = path if path is not None else os.environ.get(ENV)
    if not path:
        return 0.0
    started = time.monotonic()
    said = False
    while (deadline := read(path)) is not None and time.monotonic() >= deadline:
        if not said:
            print("the agent's lease lapsed: waiting for it before the next step", file=sys.stderr, flush=True)
            said = True
        time.sleep(POLL_S)
    return time.monotonic() - started if said else 0.0
