"""Each tenant's own turns at something slow the gateway does for it (grader calls: a sandbox, a judge): a few of
its calls run at once, a few more wait, and a call past that is refused with a 429 naming the limit. One tenant's
calls wait only on that tenant's own turns, never on another's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.gateway.errors import OpenAIError


@dataclass
class _Gate:
    slots: asyncio.Semaphore
    users: int = 0  # calls running or waiting


class TenantTurns:
    """`at_once` calls of one tenant run, `waiting` more wait their turn; `what` names the calls in a refusal."""

    def __init__(self, what: str, at_once: int, waiting: int) -> None:
        self.what, self.at_once, self.waiting = what, max(1, at_once), max(0, waiting)
        self._gates: dict[str, _Gate] = {}

    @asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        gate = self._gates.setdefault(tenant, _Gate(asyncio.Semaphore(self.at_once)))
        if gate.users >= self.at_once + self.waiting:
            raise OpenAIError(
                429,
                f"this tenant already has {gate.users} {self.what} running or waiting here ({self.at_once} run at "
                f"a time, {self.waiting} more may wait): wait for some to finish before sending more",
                None,
                "rate_limit_exceeded",
            )
        gate.users += 1
        try:
            async with gate.slots:
                yield
        finally:
            gate.users -= 1
            if gate.users == 0 and self._gates.get(tenant) is gate:
                del self._gates[tenant]
