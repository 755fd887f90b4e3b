"""The trainer speaks to its agent in JSON lines on stdout, one event each (rank 0 of a multi-device job alone)."""

from __future__ import annotations

import contextlib
import sys
import threading

import msgspec

_enc = msgspec.json.Encoder()
_muted = False
_writing = threading.Lock()  # one line at a time, whole, from whichever thread


def mute() -> None:
    """This process is not the job's rank 0: its events would repeat rank 0's."""
    global _muted
    _muted = True


@contextlib.contextmanager
def muted():
    """No events while inside (a caller that runs the trainer's loop in its own process, for its result alone)."""
    global _muted
    was, _muted = _muted, True
    try:
        yield
    finally:
        _muted = was


def emit(event) -> None:
    if _muted:
        return
    line = memoryview(_enc.encode(event) + b"\n")
    out = sys.stdout.buffer  # the raw pipe under PYTHONUNBUFFERED (the agent's): a write may take part of a line
    with _writing:
        while line:  # (a signal, a pause's, that comes while the pipe is full cuts a write short)
            line = line[out.write(line) or 0 :]
        out.flush()
