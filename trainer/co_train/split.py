"""A group whose shared step ran out of memory splits instead of failing its jobs: the step was undone for every
job (trainer/co_train/group.py); the job that took the most of it leaves, with a checkpoint of where it stands,
and is handed back to the queue to train alone from there (a Requeue event: the agent stores the checkpoint, then
reports the job queued with JobStatus.train_alone); the others take the step again without it. Each time the
step fails again the next largest leaves, down to the last job, which is handed back too (a job alone in a group
that runs out of memory is no different from one in a group of many: it trains alone, sized by its whole need).

What the leaving job is told names only itself: never its neighbours, their data or their number."""

from __future__ import annotations

import sys

from schemas.events import Requeue
from trainer.co_train.group import StepOutOfMemory


def leave_for_memory(group, oom: StepOutOfMemory) -> None:
    """The largest job of the failed step leaves `group` (trainer/co_train/process.py's Group), handed back."""
    name = oom.largest
    member = group.members.get(name)
    if member is None:  # not a member any more (cannot be: only members step); the others take the step again
        return
    at, positions = member.job.at, oom.positions[name]
    print(
        f"job {name}: the shared step ran out of memory ({oom.error}) with {len(oom.positions)} job(s) in it; it "
        f"took the most ({positions:,} token positions) and leaves to train alone from step {at.step}",
        file=sys.stderr,
        flush=True,
    )
    checkpoint, where = "", f"step {at.step}"
    if at.step > (member.resumed_from or 0):  # else where it started from is where it goes on from
        try:
            checkpoint = str(member.save())
        except Exception as e:  # out of memory again, or the disk: it goes on from the checkpoint before
            print(f"job {name}: no checkpoint taken as it left ({e!r})", file=sys.stderr, flush=True)
            where = "its last stored checkpoint"
    member.emit(
        Requeue(
            step=at.step,
            checkpoint=checkpoint,
            message=f"the co-training group's shared step ran out of memory; this job took the most of it "
            f"({positions:,} token positions), so it left the group and was handed back to train alone from {where}",
        )
    )
    group.drop(name)
