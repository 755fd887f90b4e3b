"""Which device a job can run on: the fleet's free slots, indexed so placement never scans every GPU."""

from __future__ import annotations

import bisect
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, KeysView
from dataclasses import dataclass, field

from schemas.memory import ModelShape
from schemas.nodes import Device, Heartbeat

SlotKey = tuple[str, int]  # (node, device index)


BUSY_SCAN = 256  # fitting devices compared for their engines' load (beyond that, best fit alone)
GANG_SCAN = 64  # nodes with as many free devices as a multi-device job needs compared for their fit, at most


@dataclass
class NodeView:
    """The last heartbeat of a node and when it came."""

    heartbeat: Heartbeat
    last_seen: float  # time.monotonic()
    last_seen_wall: float
    devices: dict[int, Device] = field(default_factory=dict)
    _running: frozenset[str] | None = None

    @property
    def running(self) -> frozenset[str]:
        """The jobs its last heartbeat lists running (read once per heartbeat)."""
        if self._running is None:
            self._running = frozenset(a.job for a in self.heartbeat.attempts if a.state == "running")
        return self._running


class Fleet:
    """Nodes, their devices, and an index of the free ones by free MiB.

    A device is free when no jetlora job runs on it (by its heartbeat) and the
    scheduler has not reserved it for a job it assigned. One job per device.
    """

    def __init__(self) -> None:
        self.nodes: OrderedDict[str, NodeView] = OrderedDict()  # least recently heard first
        self.reserved: dict[SlotKey, str] = {}  # slot -> job the scheduler placed there
        self._free: dict[str, list[tuple[int, str, int]]] = {"cuda": [], "cpu": []}  # sorted (free_mib, node, index)
        self._indexed: dict[SlotKey, tuple[str, tuple[int, str, int]]] = {}
        self._free_on: dict[str, int] = {}  # node -> its free devices (nodes with none are absent): gangs look here
        self._with_free: dict[int, set[str]] = {}  # how many free devices -> the nodes with that many
        self._largest: dict[tuple[str, ...], tuple[str, Device] | None] = {}  # cache; cleared when totals change
        self.busy: dict[SlotKey, float] = {}  # devices whose serving engine was busy lately: the fraction of polls
        self._shapes: dict[str, dict[str, ModelShape]] = {}  # model directory -> node -> its shape there
        self.device_count = 0  # devices of the nodes heard (what tenants share)

    # --- the index -------------------------------------------------------------------------
    def _unindex(self, key: SlotKey) -> None:
        entry = self._indexed.pop(key, None)
        if entry:
            self._count_free(key[0], -1)
            kind, item = entry
            lst = self._free[kind]
            i = bisect.bisect_left(lst, item)
            if i < len(lst) and lst[i] == item:
                del lst[i]

    def _reindex(self, node: str, dev: Device) -> bool:
        """Index the device as it stands; True when it went into the index (as free, or with other free MiB)."""
        key = (node, dev.index)
        item = (dev.free_mib, node, dev.index)
        want = (
            not dev.jobs
            and key not in self.reserved
            and not dev.reclaim_mib  # an engine wanting memory: no new job
            and not dev.failed
        )
        old = self._indexed.get(key)
        if old and (not want or old[1] != item):
            self._unindex(key)
            old = None
        if want and not old:
            bisect.insort(self._free[dev.kind], item)
            self._indexed[key] = (dev.kind, item)
            self._count_free(node, 1)
            return True
        return False

    def _count_free(self, node: str, change: int) -> None:
        before = self._free_on.get(node, 0)
        count = before + change
        if before > 0:
            self._with_free[before].discard(node)
        if count > 0:
            self._free_on[node] = count
            self._with_free.setdefault(count, set()).add(node)
        else:
            self._free_on.pop(node, None)

    def _freest(self, at_least: int = 1) -> Iterator[tuple[str, int]]:
        """(node, its free devices) of the nodes with `at_least` free devices, the most first: what a gang looks at,
        which costs what the fleet has free that many together, not its size."""
        for count in sorted((c for c in self._with_free if c >= at_least), reverse=True):
            for node in self._with_free[count]:
                yield node, count

    # --- what heartbeats and assignments change ---------------------------------------------------
    def heard(self, hb: Heartbeat, now: float | None = None) -> bool:
        """Record a heartbeat; True when it may have made room for a queued job."""
        now = time.monotonic() if now is None else now
        view = self.nodes.get(hb.node)
        if view is None:
            view = NodeView(hb, now, time.time())
            self.nodes[hb.node] = view
            was_draining = True  # nothing of it is indexed yet
        else:
            was_draining = view.heartbeat.draining
            view.heartbeat, view.last_seen, view.last_seen_wall, view._running = hb, now, time.time(), None
            self.nodes.move_to_end(hb.node)
        seen, counted, room = set(), len(view.devices), False
        for dev in hb.devices:
            old = view.devices.get(dev.index)
            seen.add(dev.index)
            if old == dev and not (was_draining or hb.draining):
                continue  # indexed as it stands: reserve and release keep the index of a device they change
            if old is None or old.total_mib != dev.total_mib or old.kind != dev.kind:
                self._largest.clear()
            view.devices[dev.index] = dev
            if hb.draining:
                self._unindex((hb.node, dev.index))
            else:
                room = self._reindex(hb.node, dev) or room
        for gone in set(view.devices) - seen:
            self._largest.clear()
            del view.devices[gone]
            self._unindex((hb.node, gone))
        self.device_count += len(view.devices) - counted
        self._note_engines(hb, seen)
        self._note_models(hb.node, hb.models)
        return room  # a device indexed anew (free, or with other free MiB) may take a queued job

    def _note_models(self, node: str, models: list[ModelShape]) -> None:
        """Index which nodes advertise which base models, so a job's model is looked up without a scan."""
        here = {shape.dir.rstrip("/"): shape for shape in models}
        for directory, nodes in list(self._shapes.items()):
            if node in nodes and directory not in here:
                del nodes[node]
                if not nodes:
                    del self._shapes[directory]
        for directory, shape in here.items():
            self._shapes.setdefault(directory, {})[node] = shape

    def _note_engines(self, hb: Heartbeat, devices: set[int]) -> None:
        if not hb.engines:  # most nodes serve nothing: no max over no engines for each device of each heartbeat
            if self.busy:
                for index in devices:
                    self.busy.pop((hb.node, index), None)
            return
        for index in devices:
            busy = max((e.busy_fraction for e in hb.engines if not e.devices or index in e.devices), default=0.0)
            if busy > 0:
                self.busy[(hb.node, index)] = busy
            else:
                self.busy.pop((hb.node, index), None)

    def forget(self, node: str) -> None:
        view = self.nodes.pop(node, None)
        self._note_models(node, [])
        if view:
            self._largest.clear()
            self.device_count -= len(view.devices)
            for i in view.devices:
                self._unindex((node, i))

    def reserve(self, key: SlotKey, job: str) -> None:
        self.reserved[key] = job
        self._unindex(key)

    def release(self, key: SlotKey, job: str) -> None:
        """The job left the slot (ended, failed, re-queued)."""
        if self.reserved.get(key) == job:
            del self.reserved[key]
            view = self.nodes.get(key[0])
            if view and key[1] in view.devices and not view.heartbeat.draining:
                self._reindex(key[0], view.devices[key[1]])

    # --- queries -----------------------------------------------------------------------------
    @staticmethod
    def kinds(accelerator: str) -> tuple[str, ...]:
        return {"gpu": ("cuda",), "cpu": ("cpu",), "any": ("cuda", "cpu")}[accelerator]

    def find(
        self, need_mib: int, accelerator: str, node: str | None = None, held: Container[str] = ()
    ) -> SlotKey | None:
        """The free device with the least free memory that still fits (best fit), or None; nodes in `held` are
        kept for a multi-device job that waits for them."""
        kinds = self.kinds(accelerator)
        if node is not None:
            fits = self._fitting(node, need_mib, kinds)
            return (node, fits[0][1]) if fits else None
        best, best_key = None, None
        for kind in kinds:
            lst = self._free[kind]
            i = bisect.bisect_left(lst, (need_mib, "", -10))
            for j in range(i, min(len(lst), i + BUSY_SCAN) if self.busy else len(lst)):  # islice would step over
                item = lst[j]  # the i devices too small, one by one
                if item[1] in held:
                    continue
                key = (self._busy_bucket((item[1], item[2])), item)  # idle engines first, then best fit
                if best_key is None or key < best_key:
                    best, best_key = item, key
                if not self.busy:
                    break  # the first that fits is the best fit
        return (best[1], best[2]) if best else None

    def _busy_bucket(self, slot: SlotKey) -> int:
        """How busy the device's serving engine has been, in quarters: a device beside an idle engine wins over
        a better-fitting one beside a busy engine."""
        return round(self.busy.get(slot, 0.0) * 4)

    def _fitting(self, node: str, need_mib: int, kinds) -> list[tuple[int, int]]:
        """(free MiB, index) of the node's free devices that fit, least free first."""
        view = self.nodes.get(node)
        if not view:
            return []
        return sorted(
            (d.free_mib, d.index)
            for d in view.devices.values()
            if d.kind in kinds and d.free_mib >= need_mib and (node, d.index) in self._indexed
        )

    def find_gang(
        self, need_mib: int, accelerator: str, count: int, node: str | None = None, held: Container[str] = ()
    ) -> list[SlotKey] | None:
        """`count` free devices of one node, each with need_mib free, or None: a job on several devices is placed
        whole or not at all. The node is the best-fitting one among those with the fewest free devices that hold it
        (so that nodes freer still stay whole for larger jobs), of GANG_SCAN of them at most: a gang costs what the
        fleet has free that many together, never the fleet's size."""
        kinds, best = self.kinds(accelerator), None
        if node is not None:
            fits = self._fitting(node, need_mib, kinds)[:count]
            return [(node, i) for _, i in fits] if len(fits) == count else None
        for free in sorted(c for c in self._with_free if c >= count):  # the tightest nodes first
            for name in itertools.islice((n for n in self._with_free[free] if n not in held), GANG_SCAN):
                fits = self._fitting(name, need_mib, kinds)[:count]
                if len(fits) == count and (best is None or sum(f for f, _ in fits) < best[0]):
                    best = (sum(f for f, _ in fits), [(name, i) for _, i in fits])
            if best is not None:
                return best[1]
        return None

    def most_devices(self, need_mib: int, accelerator: str, node: str | None = None) -> tuple[int, str | None]:
        """The most devices with need_mib total memory one node has (whether free or not), and that node."""
        kinds = self.kinds(accelerator)
        best: tuple[int, str | None] = (0, None)
        for name, view in self.views(node):
            count = sum(1 for d in view.devices.values() if d.kind in kinds and d.total_mib >= need_mib)
            best = max(best, (count, name), key=lambda b: b[0])
        return best

    def largest_room(self, count: int, node: str | None, held_mib: Callable[[SlotKey], int]) -> tuple[int, str]:
        """The most memory `count` GPUs of one node would have once jetlora's jobs on them end (what serving
        engines hold stays held), and where: the count-th roomiest device of the best node."""
        best = (0, "no GPU node")
        for name, view in self.views(node):
            rooms = sorted(
                (min(d.total_mib, d.free_mib + held_mib((name, d.index))), d.index)
                for d in view.devices.values()
                if d.kind == "cuda"
            )
            if len(rooms) >= count and rooms[-count][0] > best[0]:
                room, index = rooms[-count]
                best = (room, f"{name} device {index}" if count == 1 else f"{count} devices of {name}")
        return best

    def model_shape(self, base_dir: str, node: str | None = None) -> ModelShape | None:
        """The shape of the model at base_dir, from the heartbeats of the nodes that have it (of `node` alone, when
        given)."""
        nodes = self._shapes.get(base_dir.rstrip("/"), {})
        return nodes.get(node) if node is not None else next(iter(nodes.values()), None)

    def views(self, node: str | None) -> list[tuple[str, NodeView]]:
        """(name, view) of that node (none when it is unknown), or of every node."""
        if node is not None:
            return [(node, self.nodes[node])] if node in self.nodes else []
        return list(self.nodes.items())

    def gang_home(self, need_mib: int, accelerator: str, count: int, held: Container[str] = ()) -> str | None:
        """The node a waiting multi-device job should have kept for it: one with enough devices big enough, and
        the most of them free already; None when no node has them."""
        kinds, best = self.kinds(accelerator), None
        freest = (n for n, _ in self._freest())  # the nodes with free devices, most first
        for name in itertools.chain(freest, self.nodes):  # then any: the first able one, none free
            free = self._free_on.get(name, 0)
            if best is not None and free <= best[0]:
                break  # no node left can have more of them free
            view = self.nodes.get(name)
            if view is None or name in held or view.heartbeat.draining:
                continue
            able = [d for d in view.devices.values() if d.kind in kinds and d.total_mib >= need_mib]
            if len(able) >= count:
                ready = len(self._fitting(name, need_mib, kinds)) if free else 0
                if best is None or ready > best[0]:
                    best = (ready, name)
        return best[1] if best else None

    def free_nodes(self) -> KeysView[str]:
        """The nodes with a free device (a live view)."""
        return self._free_on.keys()

    def any_free(self) -> bool:
        return bool(self._free["cuda"] or self._free["cpu"])

    def largest(self, accelerator: str, node: str | None = None) -> tuple[str, Device] | None:
        """The device with the most total memory that such a job could use, to say why a job can never fit."""
        if node is None:
            key = self.kinds(accelerator)
            if key not in self._largest:
                self._largest[key] = self._scan_largest(key, self.nodes.values())
            return self._largest[key]
        return self._scan_largest(self.kinds(accelerator), [view for _, view in self.views(node)])

    @staticmethod
    def _scan_largest(kinds, views) -> tuple[str, Device] | None:
        best = None
        for view in views:
            for d in view.devices.values():
                if d.kind in kinds and (best is None or d.total_mib > best[1].total_mib):
                    best = (view.heartbeat.node, d)
        return best

    def silent_since(self, deadline: float) -> list[str]:
        """Nodes last heard before `deadline` (monotonic): they stopped answering."""
        out = []
        for node, view in self.nodes.items():
            if view.last_seen >= deadline:
                break
            out.append(node)
        return out
