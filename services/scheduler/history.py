"""A job's events read back from the JOBS stream a page at a time, for clients without a JetStream consumer."""

from __future__ import annotations

import msgspec
from nats.js.errors import NotFoundError

from schemas import names, subject_parts
from schemas.events import EventEntry, EventPage, EventsQuery, JobEvent, Preparing, StateChange
from schemas.job_status import JobStatus

_event = msgspec.json.Decoder(JobEvent)


async def events_page(js, q: EventsQuery, status: JobStatus, tenant: str | None) -> EventPage:
    """The job's events after stream sequence q.after, at most q.limit, oldest first; each read with one
    next-by-subject lookup, so no consumer is made and none is left behind. Only what the holders of the job's
    attempts sent is its history: another node's events on its own subjects are left out."""
    subject = names.job_events(q.job, names.tenant_token(tenant))
    entries: list[EventEntry] = []
    seq = q.after
    while len(entries) < q.limit:
        msg = await _next(js, seq + 1, subject)
        if msg is None:
            return EventPage(job=q.job, events=entries, next=seq, more=False)
        seq = msg.seq
        node = subject_parts.job_and_node_of_subject(msg.subject)[1]
        try:
            event = _event.decode(msg.data)
        except msgspec.DecodeError:
            continue  # not an event this version knows
        if not _from_holder(event, node, status):
            continue
        if q.after_step is not None and not isinstance(event, (StateChange, Preparing)) and event.step <= q.after_step:
            continue
        entries.append(EventEntry(seq=seq, event=event, node=node))
    return EventPage(job=q.job, events=entries, next=seq, more=await _next(js, seq + 1, subject) is not None)


def _from_holder(event: JobEvent, node: str, status: JobStatus) -> bool:
    """Whether `node` held the job when it sent `event`: a state change names its attempt, which must be that
    node's; other events must come from a node that held some attempt."""
    holders = status.held_by or ([status.node] if status.node else [])  # records from before held_by: the current
    if isinstance(event, StateChange) and status.held_by and event.attempt:
        return event.attempt <= len(status.held_by) and status.held_by[event.attempt - 1] == node
    return node in holders


async def _next(js, seq: int, subject: str):
    try:
        return await js.get_msg(names.JOBS_STREAM, seq=seq, subject=subject, next=True)
    except NotFoundError:
        return None
