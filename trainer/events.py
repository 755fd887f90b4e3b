"""The trainer speaks to its agent in JSON lines on stdout, one event each (rank 0 of a multi-device job alone)."""

from __future__ import annotations

import contextlib
import sys

import msgspec

_enc = msgspec.json.Encoder()
_muted = False


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
    sys.stdout.buffer.write(_enc.encode(event) + b"\n")
    sys.stdout.buffer.flush()
