"""A stand-in co-training group for control-plane tests and bench/chaos.py: speaks the group's protocol (GroupControl
lines in on stdin, GroupEvent lines out on stdout), holds each job for HOLD_S seconds in HOLD_STEPS steps, and
writes each a small adapter directory, as tests/programs/hold_trainer.py does for a job alone. Jobs join and leave
between steps; cancel drops one at once, stop and pause end one after its step (pause with a checkpoint at its
step, which a later attempt goes on from); hold and go keep one out of the steps. The real group process is
tested in tests/test_co_train_process.py."""

import os
import queue
import sys
import threading
import time
from pathlib import Path

import msgspec

from schemas.events import Checkpoint, Finished, GroupControl, GroupEvent, Progress, Started, TrainerSpec
from trainer import lease

HOLD_S = float(os.environ.get("HOLD_S", "0.5"))
STEPS = int(os.environ.get("HOLD_STEPS", "10"))
MARKS = os.environ.get("HOLD_LOG")  # which attempt computed which step, when (the fault tests read it)
TICK_S = 0.02
_decode = msgspec.json.Decoder(GroupControl)


class Member:
    def __init__(self, spec: TrainerSpec) -> None:
        self.spec, self.asked, self.held = spec, "", False
        self.step = int((Path(spec.resume_from) / "step").read_text()) if spec.resume_from else 0
        self.next_at = time.monotonic() + HOLD_S / STEPS


def emit(member: Member, event) -> None:
    line = GroupEvent(job=member.spec.job, attempt=member.spec.attempt, event=event)
    print(msgspec.json.encode(line).decode(), flush=True)


def finish(member: Member, state: str) -> None:
    out = Path(member.spec.out_dir)
    if state == "paused":
        where = out / "checkpoints" / f"step-{member.step}"
        where.mkdir(parents=True, exist_ok=True)
        (where / "step").write_text(str(member.step))
        emit(member, Checkpoint(step=member.step, path=str(where)))
    else:
        where = out / "adapter"
        where.mkdir(parents=True, exist_ok=True)
        (where / "adapter_config.json").write_text('{"r": 1}')
    emit(member, Finished(state=state, step=member.step, adapter_dir=str(where)))  # type: ignore[arg-type]


def read_lines(lines: queue.Queue) -> None:
    for raw in sys.stdin.buffer:
        if raw.strip():
            lines.put(_decode.decode(raw))
    lines.put(None)


def handle(members: dict[str, Member], c: GroupControl) -> None:
    member = members.get(c.job)
    if c.action == "add" and c.spec is not None:
        if member is None or member.spec.attempt < c.spec.attempt:
            members[c.job] = joined = Member(c.spec)
            emit(joined, Started(steps=STEPS, examples=len(c.spec.request.data)))
    elif member is None or (c.attempt and c.attempt != member.spec.attempt):
        return  # a line for an attempt the group no longer holds
    elif c.action == "cancel":
        del members[c.job]
    elif c.action in ("hold", "go"):
        member.held = c.action == "hold"
    elif member.asked != "pause":
        member.asked = c.action


def step(members: dict[str, Member]) -> None:
    now = time.monotonic()
    for job, member in list(members.items()):
        if member.asked:
            finish(member, "paused" if member.asked == "pause" else "stopped")
            del members[job]
        elif member.step >= STEPS:
            finish(member, "trained")
            del members[job]
        elif not member.held and now >= member.next_at:
            member.step += 1
            member.next_at = now + HOLD_S / STEPS
            if MARKS:
                with open(MARKS, "a") as f:
                    f.write(f"{job} {member.spec.attempt} {member.step} {time.time():.3f} {os.getpid()}\n")
            emit(member, Progress(step=member.step, steps=STEPS, loss=1.0 / member.step))


def main() -> None:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(lines,), daemon=True).start()
    members: dict[str, Member] = {}
    closed = False
    while not (closed and not members):
        try:
            c = lines.get(timeout=TICK_S)
            while c is not None:
                handle(members, c)
                c = lines.get_nowait()
            closed = True  # stdin ended: the group ends once its last job does
        except queue.Empty:
            pass
        lease.hold_while_lapsed()  # as a real group does before each step
        step(members)


if __name__ == "__main__":
    main()
