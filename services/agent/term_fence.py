"""Which scheduler a node obeys: the newest term it has seen, from the commands it took and from the lease it reads
before it obeys one. A command of an older term comes from a scheduler that was deposed while it stalled (its
successor may already have placed, moved or ended what that command is about): it is refused, answering `deposed`.
The scheduler's side: services/scheduler/commands.py."""

from __future__ import annotations

import asyncio
import logging

from schemas.leadership import LEASE_STREAM, LEASE_SUBJECT, decode_lease

log = logging.getLogger(__name__)
LEASE_READ_S = 1.0  # a lease that cannot be read in this long leaves the term this node remembers


class TermFence:
    """The newest scheduler term this node has seen; refuses the commands of older ones."""

    def __init__(self, js) -> None:
        self.js = js
        self.newest = 0
        self._told: set[int] = set()  # older terms whose refusal was logged (once each)

    async def refusal(self, term: int, what: str) -> str | None:
        """Why `what` (a command of `term`) is refused, or None: it is the newest term's, which is remembered."""
        self.newest = max(self.newest, term, await self._lease_term())
        if term >= self.newest:
            return None
        if term not in self._told:
            self._told.add(term)
            log.warning(
                "refused %s from scheduler term %d: a scheduler of term %d leads now (the older one was deposed "
                "while it stalled); its commands are refused from here on",
                what,
                term,
                self.newest,
            )
        return f"deposed: this command comes from scheduler term {term}, and a scheduler of term {self.newest} leads"

    async def _lease_term(self) -> int:
        """The term in the lease as stored now; 0 when it cannot be read (no scheduler leads, NATS away)."""
        try:
            msg = await asyncio.wait_for(self.js.get_last_msg(LEASE_STREAM, LEASE_SUBJECT), LEASE_READ_S)
        except Exception as e:
            log.debug("could not read the scheduler lease (%s: %s)", type(e).__name__, e)
            return 0
        return decode_lease(msg.data or b"").term
