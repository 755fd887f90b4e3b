"""Which nodes are live, as the registry knows it: it hears every agent's heartbeat on jetlora.node.<node>.heartbeat
(the node is the subject's, which an agent's permissions let it publish only as itself) and times each on its own
monotonic clock, never by a time an agent wrote. A node is live while it has missed fewer than LIVE_MISSES of the
heartbeats its interval promises; a canary picks only live nodes. A node not heard for `departed_s` has left: its
adapter statuses are purged from the registry, and the purge markers after them once every view has seen them go,
so the registry holds statuses of the nodes that are there, not of every node that ever was.

Each registry instance listens for itself. One that has just started has heard nobody yet: it counts nodes as
heard when it started, so it removes nothing before it has listened for `departed_s` itself."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client

from schemas import names, subject_parts
from services import fanout
from services.aio import sleep_unless_stopped
from services.registry.store import AdapterRegistry

log = logging.getLogger(__name__)
LIVE_MISSES = 3  # heartbeats a node may miss and still be live
MAX_INTERVAL_S = 60.0  # the most of a node's declared heartbeat interval that counts
DEPARTED_S = 3600.0  # not heard this long: the node has left, and its statuses go
SWEEP_S = 30.0  # how often departed nodes' statuses are looked for
MARKER_GRACE_S = 60.0  # a purge marker stays this long (at most departed_s), for every view to see the status go


class _Beat(msgspec.Struct):
    """What the registry reads of a heartbeat: the interval the node promises (the rest is skipped unread)."""

    interval_s: float = 1.0


_beat = msgspec.json.Decoder(_Beat)


class NodeLiveness:
    def __init__(
        self, nc: Client, registry: AdapterRegistry, departed_s: float = DEPARTED_S, sweep_s: float = SWEEP_S
    ) -> None:
        self.nc, self.registry = nc, registry
        self.departed_s, self.sweep_s = departed_s, sweep_s
        self.marker_grace_s = min(MARKER_GRACE_S, departed_s)
        self.since = time.monotonic()  # listening since: a node not heard yet counts as heard then
        self.heard: dict[str, tuple[float, float]] = {}  # node -> (monotonic time heard, its interval)
        self.markers: dict[str, tuple[int, float]] = {}  # status key -> (its purge marker's sequence, when purged)

    async def run(self, stop: asyncio.Event) -> None:
        """Hear heartbeats, and sweep departed nodes' statuses every sweep_s, until `stop`."""
        sub = await fanout.listen(self.nc, names.HEARTBEATS_ALL, self._heard)  # the scheduler beside it hears them too
        self.since = time.monotonic()
        try:
            while not await sleep_unless_stopped(stop, self.sweep_s):
                try:
                    await self.sweep()
                except Exception as e:  # the bucket or its view away: the next sweep goes on
                    log.warning("registry: removing departed nodes' statuses stopped (%s: %s)", type(e).__name__, e)
        finally:
            await sub.unsubscribe()

    async def _heard(self, msg) -> None:
        try:
            interval = _beat.decode(msg.data).interval_s
        except msgspec.DecodeError:
            interval = 1.0  # a heartbeat all the same: the node is there
        self.heard[subject_parts.node_of_subject(msg.subject)] = (
            time.monotonic(),
            min(max(interval, 0.01), MAX_INTERVAL_S),
        )

    def live(self, node: str) -> bool:
        """Heard within LIVE_MISSES of its heartbeat intervals."""
        heard = self.heard.get(node)
        return heard is not None and time.monotonic() - heard[0] <= LIVE_MISSES * heard[1]

    def silent_for(self, node: str) -> float:
        """Seconds since this registry last heard the node (or, never heard, since it began listening)."""
        return time.monotonic() - max(self.heard.get(node, (self.since, 0.0))[0], self.since)

    async def sweep(self) -> None:
        """Purge the statuses of departed nodes; remove purge markers old enough; forget departed nodes."""
        keys = [k for k in (await self.registry.view.snapshot()) if k.startswith("node.")]  # type: ignore[union-attr]
        gone: dict[str, list[str]] = {}
        for key in keys:
            node = key.split(".", 2)[2]
            if self.silent_for(node) > self.departed_s:
                self.markers[key] = (await self.registry.forget_node_status(key), time.monotonic())
                gone.setdefault(node, []).append(key.split(".", 2)[1])
        for node, adapters in gone.items():
            log.info(
                "registry: node %s has not been heard for %.0fs: removed its statuses of %s",
                node,
                self.silent_for(node),
                ", ".join(sorted(adapters)),
            )
        for key, (seq, purged) in list(self.markers.items()):
            if time.monotonic() - purged >= self.marker_grace_s and await self.registry.drop_marker(key, seq):
                del self.markers[key]
        for node in [n for n in self.heard if self.silent_for(n) > self.departed_s]:
            del self.heard[node]
