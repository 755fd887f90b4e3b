"""The trainer speaks to its agent in JSON lines on stdout, one event each (rank 0 of a multi-device job alone)."""

from __future__ import annotations

import sys

import msgspec

_enc = msgspec.json.Encoder()
_muted = False


def mute() -> None:
    """This process is not the job's rank 0: its events would repeat rank 0's."""
    global _muted
    _muted = True


def emit(event) -> None:
    if _muted:
        return
    sys.stdout.buffer.write(_enc.encode(event) + b"\n")
    sys.stdout.buffer.flush()
