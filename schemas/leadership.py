"""Who leads the schedulers, as the lease bucket stores it: the holder and its term. Agents read it (and remember
the highest term any command carried) to refuse the commands of a scheduler that was deposed while it stalled."""

from __future__ import annotations

import msgspec
from msgspec import Struct

from schemas import names, nats_subjects

LEASE_KEY = "scheduler"  # the lease's one key in names.LEASE_KV


class LeaseRecord(Struct, kw_only=True, omit_defaults=True):
    """The lease key's value: the scheduler that holds it, and the term it leads in (0 until it took one)."""

    holder: str
    term: int = 0


def encode_lease(record: LeaseRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_lease(value: bytes) -> LeaseRecord:
    """The stored record; a bare holder name (what schedulers before terms in the lease wrote) has term 0."""
    try:
        return msgspec.json.decode(value, type=LeaseRecord)
    except msgspec.DecodeError:
        return LeaseRecord(holder=value.decode(errors="replace"))


LEASE_STREAM = nats_subjects.kv(names.LEASE_KV).stream
LEASE_SUBJECT = nats_subjects.kv(names.LEASE_KV).prefix + LEASE_KEY
