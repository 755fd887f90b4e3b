"""What the scheduler asks the adapter registry, over NATS only (jetlora.adapters.*): an adapter as it stands (at
submit: a name's owner, an init adapter's version), and the registration of a succeeded job's adapter, asked again
while the registry does not answer and never lost silently: the job's message says how it went."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client

from schemas import names
from schemas.jobs import Error, JobId, RegisterSpec
from schemas.registry import AdapterQuery, AdapterReply, RegisterRequest
from services import bus
from services.aio import sleep_unless_stopped

log = logging.getLogger(__name__)
ASK_TIMEOUT_S = 5.0  # a submission waits this long for the registry's word on an adapter
REGISTER_TIMEOUT_S = 15.0  # a registration reads the job's record and writes the bucket: more than a lookup
REGISTER_PAUSES_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 30.0, 30.0, 30.0, 30.0)  # ~3 minutes of a registry away


class RegistryUnanswered(Exception):
    """The registry did not answer (or failed on the request): what happened, for the asker's reply."""


async def adapter(nc: Client, name: str, timeout: float = ASK_TIMEOUT_S) -> AdapterReply | None:
    """The registry's adapter `name` (its alias, versions and node statuses); None when it has none."""
    try:
        reply = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name=name), AdapterReply | Error, timeout)
    except bus.RequestError as e:
        raise RegistryUnanswered(f"the adapter registry did not answer ({e})") from None
    if isinstance(reply, Error):
        if reply.field == "name":  # no adapter of that name
            return None
        raise RegistryUnanswered(f"the adapter registry failed on it ({reply.error})")
    return reply


def registered_note(reply: AdapterReply, name: str, job: JobId, promote: bool) -> str | None:
    """What the job's message says of its registration, from the registry's adapter; None when no version of
    `name` is made of the job."""
    made = [v.version for v in reply.versions if v.job == job]
    if not made:
        return None
    promoted = promote and reply.alias.current == max(made)
    gate = reply.alias.gate
    if promote and not promoted and gate is not None and gate.version == max(made):
        return (
            f"registered as {name}@{max(made)}; gate {gate.eval} decides its promote (`jetlora adapters show {name}`)"
        )
    return f"registered as {name}@{max(made)}" + (" and promoted" if promoted else "")


async def register(nc: Client, job: JobId, spec: RegisterSpec, stopped: asyncio.Event) -> str | None:
    """Ask the registry to register the job's adapter as the next version of spec.name (promoted if asked); while it
    does not answer, ask again (after a time-out, only once its adapter shows no version made of the job, so that
    none is registered twice). The note for the job's message; None when `stopped` (this scheduler stopped
    leading) ended the asking."""
    asked = RegisterRequest(name=spec.name, job=job, promote=spec.promote, gate=spec.gate)
    last = ""
    for attempt, pause in enumerate((0.0, *REGISTER_PAUSES_S)):
        if attempt and await sleep_unless_stopped(stopped, pause):
            log.warning("job %s: stopped leading while registering its adapter as %s (%s)", job, spec.name, last)
            return None
        try:
            if attempt and (found := await adapter(nc, spec.name)) is not None:
                if (note := registered_note(found, spec.name, job, spec.promote)) is not None:
                    return note  # the time-out hid an answer: it was registered
            reply = await bus.request(nc, names.ADAPTERS.register, asked, AdapterReply | Error, REGISTER_TIMEOUT_S)
        except (RegistryUnanswered, bus.RequestError) as e:
            last = str(e)
            log.warning("job %s: registering its adapter as %s: %s; asking again", job, spec.name, last)
            continue
        if isinstance(reply, Error):
            return _not_registered(job, f"not registered as {spec.name}: {reply.error}")
        return registered_note(reply, spec.name, job, spec.promote) or f"registered as {spec.name}"
    return _not_registered(
        job,
        f"not registered as {spec.name}: {last} for {sum(REGISTER_PAUSES_S):.0f}s; register it with "
        f"`jetlora adapters register {spec.name} {job}`",
    )


def _not_registered(job: JobId, note: str) -> str:
    """Why the job's adapter was not registered: logged, and the note for its message."""
    log.warning("job %s: %s", job, note)
    return note
