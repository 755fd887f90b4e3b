"""A job's events read back from the JOBS stream a page at a time, for clients without a JetStream consumer."""

from __future__ import annotations

import msgspec
from nats.js.errors import NotFoundError

from schemas import names
from schemas.events import EventEntry, EventPage, EventsQuery, JobEvent, Preparing, StateChange

_event = msgspec.json.Decoder(JobEvent)


async def events_page(js, q: EventsQuery) -> EventPage:
    """The job's events after stream sequence q.after, at most q.limit, oldest first; each read with one
    next-by-subject lookup, so no consumer is made and none is left behind."""
    subject = names.job_events(q.job)
    entries: list[EventEntry] = []
    seq = q.after
    while len(entries) < q.limit:
        msg = await _next(js, seq + 1, subject)
        if msg is None:
            return EventPage(job=q.job, events=entries, next=seq, more=False)
        seq = msg.seq
        try:
            event = _event.decode(msg.data)
        except msgspec.DecodeError:
            continue  # not an event this version knows
        if q.after_step is not None and not isinstance(event, (StateChange, Preparing)) and event.step <= q.after_step:
            continue
        entries.append(EventEntry(seq=seq, event=event))
    return EventPage(job=q.job, events=entries, next=seq, more=await _next(js, seq + 1, subject) is not None)


async def _next(js, seq: int, subject: str):
    try:
        return await js.get_msg(names.JOBS_STREAM, seq=seq, subject=subject, next=True)
    except NotFoundError:
        return None
