"""Which attempt of a job may compute, and until when: one trainer of a job at a time, whatever state its node is in.

Two parts. In the bucket TRAINER_LEASES_KV (schemas/names.py), one entry per job names the attempt that holds the
job's trainer lease (Holder): the agent running that attempt writes it before its trainer starts and renews it at
each heartbeat by compare-and-set on the entry's revision, so a renewal after another attempt took the entry over
fails, and that attempt is ended there. An attempt on another node takes the entry over only once it has seen it
unchanged for the holder's lease_s (its holder stopped renewing: it is frozen, cut off or dead) or released (its
holder ended: the entry then says "released by attempt N", not deleted, so an older attempt that comes late, an
assignment delayed in a frozen agent's socket, finds that it is older and never starts); a newer attempt's entry,
released or not, is never taken by an older one. Released entries are not deleted: each goes with the bucket's max
age (KEPT_S after its last write), as the delete markers of the entries let go before did.

The other part is local: the file through which the agent lets its trainer go on. Its path is in the trainer's
environment (ENV), and in it a deadline on CLOCK_MONOTONIC (which every process of the machine shares) as
fixed-width text. The agent moves the deadline to lease_s after the moment it sent a renewal the bucket took
(services/agent/trainer_leases.py, heartbeats.py); the trainer reads it before each step and waits once it has
passed (trainer/lease.py). A renewal is stored after it was sent and seen by another node after it was stored, so
this trainer stops (before its next step) before another node may take the entry over."""

from __future__ import annotations

import os
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from schemas.jobs import JobId

ENV = "JETLORA_LEASE"
RECORD = 32  # bytes
KEPT_S = 7 * 24 * 3600  # an entry goes from the bucket this long after its last write (released, or its node died)


class Holder(Struct, frozen=True, kw_only=True):
    """The entry of a job: the attempt whose trainer may compute, the node running it, and how long its trainer
    goes on after a renewal (the time another node waits, from when it saw the entry last change). `released`: that
    attempt ended and its trainer is gone; a later attempt takes the entry at once, this one and older ones never."""

    job: JobId
    attempt: Annotated[int, Meta(ge=1)]
    node: str
    lease_s: Annotated[float, Meta(ge=0)]
    released: bool = False


_encode = msgspec.json.Encoder()
_decode = msgspec.json.Decoder(Holder)


def key(job: str) -> str:
    return f"job.{job}"


def encode(holder: Holder) -> bytes:
    return _encode.encode(holder)


def decode(data: bytes) -> Holder:
    return _decode.decode(data)


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
