"""The trainer speaks to its agent in JSON lines on stdout, one event each."""

from __future__ import annotations

import sys

import msgspec

_enc = msgspec.json.Encoder()


def emit(event) -> None:
    sys.stdout.buffer.write(_enc.encode(event) + b"\n")
    sys.stdout.buffer.flush()
