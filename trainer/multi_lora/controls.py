"""The agent's lines to a group's process, read by a thread of their own so that a step (or a call) never waits on
stdin: GroupControl lines (a job joining, cancelled, stopped, paused, held, let go on) and, for a session group,
MemberCall lines (a call for one of its sessions, schemas/sessions.py)."""

from __future__ import annotations

import queue
import sys
import threading

import msgspec

from schemas.events import GroupControl
from schemas.sessions import CALL_LINE, MemberCall

_control = msgspec.json.Decoder(GroupControl)
_call = msgspec.json.Decoder(MemberCall)
Line = GroupControl | MemberCall


def note(text: str) -> None:
    """A line for the agent's log (stderr): what the group did that no job's events say."""
    print(text, file=sys.stderr, flush=True)


def addressed(members: dict, line: GroupControl):
    """The member a control line is for, or None (noted for the agent's log) when the group holds no such attempt:
    a line for an attempt that left, or was superseded, is left."""
    member = members.get(line.job)
    if member is None or (line.attempt and line.attempt != member.attempt):
        held = f"attempt {member.attempt}" if member else "no attempt"
        note(f"{line.action} for job {line.job} attempt {line.attempt} left: the group holds {held} of it")
        return None
    return member


class Controls:
    def __init__(self, stream) -> None:
        self.lines: queue.Queue[Line | None] = queue.Queue()
        self.closed = False  # stdin ended: no job will join any more
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            if not line.strip():
                continue
            try:
                self.lines.put(_call.decode(line) if line.startswith(CALL_LINE) else _control.decode(line))
            except msgspec.DecodeError as e:
                note(f"a control line that is not a GroupControl or MemberCall was left: {e}")
        self.lines.put(None)

    def take(self, wait: bool, timeout: float | None = None) -> list[Line]:
        """The lines come since the last call; with `wait`, at least one (or stdin's end, or `timeout` passed)."""
        out: list[Line | None] = []
        if wait and not self.closed:
            try:
                out.append(self.lines.get(timeout=timeout))
            except queue.Empty:
                pass
        while True:
            try:
                out.append(self.lines.get_nowait())
            except queue.Empty:
                break
        self.closed = self.closed or None in out
        return [c for c in out if c is not None]
