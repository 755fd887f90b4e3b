"""The Tinker API's futures: every training or sampling call is answered at once with a request id, and its result
is fetched with retrieve_future. A fetch waits for the result up to HOLD_S (a long poll), then answers 408 and the
client asks again; a result is kept a while after it is fetched (a fetch may be lost on the way back)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
HOLD_S = 25.0  # under the client's 45 s timeout on retrieve_future
KEEP_S = 600.0  # a finished result is kept this long after it is first fetched


class CallFailed(Exception):
    """A call that failed after it was accepted: the client raises RequestFailedError with this message."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.category = category


@dataclass
class Outcome:
    """What retrieve_future answers: a protobuf body, or a JSON object."""

    body: bytes | None = None
    json: Any = None


@dataclass
class Pending:
    tenant: str
    task: asyncio.Task
    created: float = field(default_factory=time.monotonic)
    fetched: float | None = None


class Futures:
    def __init__(self) -> None:
        self.pending: dict[str, Pending] = {}

    def start(self, tenant: str, work: Awaitable[Outcome]) -> str:
        """Run `work` for the tenant; the request id its result is fetched by."""
        self.expire()
        request_id = "req-" + secrets.token_hex(12)
        task = asyncio.ensure_future(work)
        task.add_done_callback(self._log_fault)
        self.pending[request_id] = Pending(tenant, task)
        return request_id

    async def retrieve(self, tenant: str, request_id: str) -> Outcome | None:
        """The result (None: not ready within HOLD_S); KeyError for an id this tenant does not have."""
        entry = self.pending.get(request_id)
        if entry is None or entry.tenant != tenant:  # another tenant's id is as unknown as a made-up one
            raise KeyError(request_id)
        done, _ = await asyncio.wait([entry.task], timeout=HOLD_S)
        if not done:
            return None
        entry.fetched = entry.fetched or time.monotonic()
        try:
            return entry.task.result()
        except CallFailed as e:
            return Outcome(json={"error": str(e), "category": e.category})
        except Exception as e:
            return Outcome(
                json={"error": f"the gateway failed on this call ({type(e).__name__}: {e})", "category": "server"}
            )

    def expire(self) -> None:
        """Results fetched KEEP_S ago, and any older than a day (never fetched, or never done), go."""
        now = time.monotonic()
        for request_id, entry in list(self.pending.items()):
            if (entry.fetched is not None and now - entry.fetched > KEEP_S) or now - entry.created > 24 * 3600:
                entry.task.cancel()
                del self.pending[request_id]

    @staticmethod
    def _log_fault(task: asyncio.Task) -> None:
        if not task.cancelled() and (e := task.exception()) is not None and not isinstance(e, CallFailed):
            log.error("a Tinker call failed in the gateway: %r", e, exc_info=e)

    async def close(self) -> None:
        tasks = [e.task for e in self.pending.values() if not e.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
