"""A job's events as OpenAI lists them, newest first, read through the scheduler's paged events API
(jetlora.api.<tenant>.events, which reads forward from a JOBS stream sequence): a page is found by windows that
double back from where it starts, so its cost follows the page, not the job's history. An event's id is
`ftevent-<stream sequence>`, so `after` says where the next page starts without any lookup of the history."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from schemas import names
from schemas.events import EventEntry, EventPage, EventsQuery, Progress
from schemas.gateway import Page
from schemas.jobs import Error
from services import bus
from services.gateway.errors import not_found
from services.gateway.lookups import unanswered
from services.gateway.openai_map import event_object
from services.gateway.paging import newest_before, paged, unknown_after

T = TypeVar("T")
EVENT_ID = re.compile(r"ftevent-([1-9][0-9]{0,18})")
FORWARD_PAGE = 1000  # the scheduler's largest page, for reading a whole history (the results file)
TOKENS_KEPT = 4096  # trained_tokens of finished jobs remembered (they never change)


class JobEvents:
    def __init__(self, nc) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self._tokens: dict[str, int | None] = {}

    async def _ask(self, tenant: str, job: str, after: int, limit: int) -> EventPage:
        query = EventsQuery(job=job, after=after, limit=limit)
        reply = await bus.request(self.nc, names.jobs_api(tenant).events, query, EventPage | Error)
        if isinstance(reply, Error):
            raise not_found("fine-tuning job", job) if reply.field == "job" else unanswered(reply)
        return reply

    async def _newest(
        self, tenant: str, job: str, hi: int | None, want: int, keep: Callable[[EventEntry], T | None]
    ) -> list[T]:
        """Up to `want` of what `keep` makes of the job's events below stream sequence `hi`, newest first."""

        async def read(lo: int, cap: int, hi: int):
            page = await self._ask(tenant, job, lo, min(cap, FORWARD_PAGE))
            items = [(e.seq, kept) for e in page.events if e.seq < hi and (kept := keep(e)) is not None]
            done = not page.more or page.next >= hi - 1 or any(e.seq >= hi for e in page.events)
            return items, done

        if hi is None:  # from the newest: one past the stream's last sequence
            hi = (await self.js.stream_info(names.JOBS_STREAM)).state.last_seq + 1
        return await newest_before(read, hi, want)

    async def page(self, tenant: str, job: str, after: str | None, limit: int) -> Page:
        """OpenAI's list_events: `limit` events older than `after` (an event id of this job), newest first."""
        hi = await self._place(tenant, job, after) if after else None
        found = await self._newest(tenant, job, hi, limit + 1, lambda e: event_object(e))
        return paged(found[:limit], len(found) > limit)

    async def _place(self, tenant: str, job: str, after: str) -> int:
        """The stream sequence of the event `after` names; a 400 naming `after` if it is not one of this job's."""
        m = EVENT_ID.fullmatch(after)
        if m is not None:
            seq = int(m[1])
            found = await self._ask(tenant, job, seq - 1, 1)
            if found.events and found.events[0].seq == seq:
                return seq
        raise unknown_after(after, "event of this job")

    async def trained_tokens(self, tenant: str, job: str) -> int | None:
        """The tokens a finished job trained on: its newest progress event's count (null without one)."""
        if job in self._tokens:
            return self._tokens[job]
        newest = await self._newest(
            tenant, job, None, 1, lambda e: e.event.tokens if isinstance(e.event, Progress) else None
        )
        tokens = newest[0] if newest else None
        if len(self._tokens) >= TOKENS_KEPT:
            self._tokens.pop(next(iter(self._tokens)))
        self._tokens[job] = tokens
        return tokens

    async def progress(self, tenant: str, job: str) -> list[Progress]:
        """Every progress event of the job, oldest first (what its results file is made of)."""
        out: list[Progress] = []
        after = 0
        while True:
            page = await self._ask(tenant, job, after, FORWARD_PAGE)
            out += [e.event for e in page.events if isinstance(e.event, Progress)]
            if not page.more or not page.events:
                return out
            after = page.next
