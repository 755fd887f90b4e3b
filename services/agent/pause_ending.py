"""Whether a pause kept what its attempt trained. An attempt is reported `paused` (the scheduler keeps it among the
job's paused_attempts, and the Tinker gateway tells a session's client nothing was lost) only once the checkpoint
its trainer took as it paused is stored whole, and that report names the checkpoint itself: one write, so an agent
killed between two never leaves the checkpoint recorded and the pause not (a loss told where none was), nor the
pause without its checkpoint. A pause whose checkpoint was not stored hands the attempt back as what it is: lost."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from schemas.events import Finished
from schemas.job_status import CheckpointInfo
from schemas.nodes import Assignment

log = logging.getLogger(__name__)


@dataclass
class Shipped:
    """A checkpoint the trainer took (its Checkpoint event) and how its trip to the object store went."""

    step: int
    info: CheckpointInfo | None = None  # stored whole: what the job's record names
    error: str = ""  # why it was not stored
    followed: asyncio.Event = field(default_factory=asyncio.Event)  # the trainer said more after it, or ended

    def kept(self, paused: Finished) -> CheckpointInfo | None:
        """This checkpoint as stored, when it is the one the trainer took as it ended `paused`."""
        return self.info if self.step == paused.step else None


def lost_pause(a: Assignment, paused: Finished, shipped: Shipped | None, newest: CheckpointInfo | None) -> str:
    """What a pause that kept nothing says, to the job's record and (logged) to the operator: what happened, where
    the job goes on from, and what to do."""
    if shipped is None or shipped.step != paused.step:
        why = "the trainer took no checkpoint as it paused"
    else:
        why = f"its checkpoint was not stored ({shipped.error or 'no answer'})"
    where = newest.name if newest is not None else a.resume_from
    goes_on = f"goes on from {where}, the newest checkpoint stored" if where else "starts again (no checkpoint stored)"
    words = (
        f"paused at step {paused.step}, but {why}: handed back to the queue as a loss, it {goes_on}; check that the "
        "artifact service (jetlora artifacts) and its object store are up, and pause the job again once it runs if "
        "it should stay paused"
    )
    log.error("job %s attempt %d: its pause at step %d is not kept: %s", a.job, a.attempt, paused.step, words)
    return words


def is_pause(end: object) -> bool:
    """Whether a trainer's end (Finished, Failed, Cancelled, Requeue; None: not yet) is a pause."""
    return isinstance(end, Finished) and end.state == "paused"


def read_pause(trainer: object) -> bool:
    """Whether the trainer's end, read already (a trainer's or a group member's `final_read`), is a pause (a
    session's for idleness, say: no pause was asked of it)."""
    return is_pause(getattr(trainer, "final_read", None))
