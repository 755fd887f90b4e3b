"""One subscription per connection and subject, heard by every listener of the process.

`jetlora scheduler` runs the scheduler and the adapter registry on one connection, and both hear every node's
heartbeat: with a subscription each, the server sent each heartbeat (~2.5 KB at 8 devices) twice and the process
parsed it twice, a ninth of its CPU in a burst of submissions at 1,000 nodes (bench/control_plane.py). Listening
here, the server sends it once and each listener is called with the same message, in the order they began to
listen; one that raises is logged and the others are still called."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

log = logging.getLogger(__name__)
Listener = Callable[[Msg], Awaitable[None]]


class _Shared:
    """The one subscription of a subject on a connection, and who listens to it."""

    def __init__(self) -> None:
        self.sub: Any = None
        self.listeners: list[Listener] = []

    async def deliver(self, msg: Msg) -> None:
        for listener in tuple(self.listeners):
            try:
                await listener(msg)
            except Exception as e:  # one listener's fault is not the others'
                log.error("a listener of %s failed: %r", msg.subject, e, exc_info=e)


_shared: weakref.WeakKeyDictionary[Client, dict[str, _Shared]] = weakref.WeakKeyDictionary()


class Listening:
    """One listener's place; unsubscribe() leaves it (the subscription ends with its last listener)."""

    def __init__(self, nc: Client, subject: str, listener: Listener) -> None:
        self.nc, self.subject, self.listener = nc, subject, listener
        self.left = False

    async def unsubscribe(self) -> None:
        if self.left:
            return
        self.left = True
        subjects = _shared.get(self.nc, {})
        shared = subjects.get(self.subject)
        if shared is None:
            return
        if self.listener in shared.listeners:
            shared.listeners.remove(self.listener)
        if not shared.listeners:
            del subjects[self.subject]
            await shared.sub.unsubscribe()


async def listen(nc: Client, subject: str, listener: Listener) -> Listening:
    """Call `listener` with each message on `subject`, through the connection's one subscription of it (made
    here when it has none)."""
    subjects = _shared.setdefault(nc, {})
    shared = subjects.get(subject)
    if shared is None:
        shared = subjects[subject] = _Shared()
        shared.listeners.append(listener)
        try:
            shared.sub = await nc.subscribe(subject, cb=shared.deliver)
        except BaseException:
            subjects.pop(subject, None)
            raise
    else:
        shared.listeners.append(listener)
    return Listening(nc, subject, listener)
