"""The file through which a node agent lets a trainer go on: its path in the trainer's environment (ENV), and in
it a deadline on CLOCK_MONOTONIC (which every process of the machine shares) as fixed-width text. The agent
writes it (services/agent/runner.py), the trainer reads it before each step (trainer/lease.py)."""

from __future__ import annotations

import os

ENV = "JETLORA_LEASE"
RECORD = 32  # bytes


def write(path: str, deadline: float) -> None:
    """Let the attempt go on until `deadline` (time.monotonic() of any process here)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, f"{deadline:<{RECORD - 1}.6f}\n".encode(), 0)
    finally:
        os.close(fd)


def read(path: str) -> float | None:
    """The deadline, or None when there is none to keep (no file, or one being rewritten this instant)."""
    try:
        with open(path, "rb") as f:
            return float(f.read(RECORD))
    except (OSError, ValueError):
        return None
