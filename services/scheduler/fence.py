"""Writes only the leader of the current term can make.

A scheduler that takes the lease then takes a term: it bumps the `term` key of the jobs bucket with a
compare-and-set. Every write it makes to that bucket afterwards carries the term key's revision in JetStream's
`Nats-Expected-Last-Subject-Sequence` header, checked against the term key (`...-Subject`). Once another scheduler
has taken a newer term, the store refuses every write of the old one, however late it arrives: a leader that
stalled past its lease cannot overwrite what its successor decided."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import nats.errors
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas.job_records import TERM
from services.jetstream_writer import (
    EXPECTED_SEQUENCE,
    EXPECTED_SUBJECT,
    WRONG_LAST_SEQUENCE,
    JetStreamWriter,
    ViaJsPublish,
)

log = logging.getLogger(__name__)
TERM_KEY = TERM  # the stored format's (schemas/job_records.py)
ATTEMPT_TIMEOUT_S = 2.0  # one try of a write
WRITE_DEADLINE_S = 6.0  # tries of one write, while the store does not answer (a leader election takes seconds)
_unanswered = (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError)


class Term(msgspec.Struct, kw_only=True):
    """The term key's value: which scheduler leads, since when."""

    term: int
    holder: str
    since: float


class Deposed(Exception):
    """Another scheduler took a newer term (or this one's lease lapsed): this one must stop leading now.
    `maybe_stored`: an earlier try of the same write went unanswered, so it may have landed before the refusal."""

    def __init__(self, message: str, maybe_stored: bool = False) -> None:
        super().__init__(message)
        self.maybe_stored = maybe_stored


class WriteUnknown(Exception):
    """The store did not answer a write in time: it may or may not have been stored."""


class Fence:
    """The writes of one term: each is refused by the store once a newer term exists."""

    def __init__(
        self,
        writer: JetStreamWriter | ViaJsPublish,
        prefix: str,
        term: int,
        revision: int,
        leading: Callable[[], bool] = lambda: True,
    ) -> None:
        self.writer, self.prefix, self.term, self.revision = writer, prefix, term, revision
        self.leading = leading  # False once the lease lapsed locally: no write is even tried
        self.headers = {EXPECTED_SEQUENCE: str(revision), EXPECTED_SUBJECT: prefix + TERM_KEY}

    @classmethod
    async def take(
        cls, writer: JetStreamWriter | ViaJsPublish, kv: KeyValue, prefix: str, holder: str, leading: Callable[[], bool]
    ) -> Fence:
        """Start a new term after the one in the bucket; raises if another scheduler started one meanwhile."""
        try:
            entry = await kv.get(TERM_KEY)
            last, revision = msgspec.json.decode(entry.value or b"", type=Term).term, entry.revision
        except KeyNotFoundError:
            last, revision = 0, 0
        value = msgspec.json.encode(Term(term=last + 1, holder=holder, since=time.time()))
        try:
            if revision:
                new = await kv.update(TERM_KEY, value, last=revision)
            else:
                new = await kv.create(TERM_KEY, value)
        except KeyWrongLastSequenceError:
            raise Deposed(f"another scheduler started term {last + 1} at the same moment") from None
        log.info("%s leads in term %d", holder, last + 1)
        return cls(writer, prefix, last + 1, new, leading)

    async def put(self, key: str, value: bytes, headers: dict[str, str] | None = None) -> int:
        """Store `value` under `key` if this term is still the newest; its revision. Raises Deposed when a newer
        term exists, WriteUnknown when the store did not answer within WRITE_DEADLINE_S. A write tried again
        writes the same bytes, so one that landed after all is only stored twice."""
        deadline = time.monotonic() + WRITE_DEADLINE_S
        headers = {**self.headers, **headers} if headers else self.headers
        unanswered = False  # a try went out and was not answered: it may land yet
        while True:
            if not self.leading():
                raise Deposed(f"the lease of term {self.term} lapsed here; nothing more is written", unanswered)
            try:
                ack = await self.writer.publish(self.prefix + key, value, headers, ATTEMPT_TIMEOUT_S)
                return ack.seq
            except BadRequestError as e:
                if e.err_code == WRONG_LAST_SEQUENCE:
                    raise Deposed(
                        f"the store refused a write of term {self.term}: another scheduler leads in a newer term",
                        unanswered,
                    ) from None
                raise
            except _unanswered as e:
                unanswered = True
                if time.monotonic() >= deadline:
                    raise WriteUnknown(
                        f"JetStream did not answer a write of {key} for {WRITE_DEADLINE_S:.0f}s ({type(e).__name__})"
                    ) from None
                await asyncio.sleep(0.1)
