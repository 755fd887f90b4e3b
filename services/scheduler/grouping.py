"""Co-training groups as the scheduler holds them: a projection of the jobs' statuses (and of the placements being
written), indexed so that the questions placement asks of them cost what one placement costs: may this queued job
join a running group, and which one fits it best.

A group lives on one device of one node. Its device is held for the group (`holder`), not for one job: the group
keeps it while any member holds it, and gives it back when the last one leaves. Which jobs may share a group is
schemas/co_train.py's rule and the operator's --co-train policy.

The index: every group with a place left sits in a sorted list of its bucket (what its jobs share, whose jobs it
takes, the device's kind) by the room its device has beyond what it already holds. A group's room changes only when
its node heartbeats or a member joins or leaves, and each of those re-files that group alone; a queued job finds the
best-fitting group of its bucket by bisection. Nothing scans all groups, nor pairs of jobs."""

from __future__ import annotations

import bisect
import itertools
import logging
import secrets
from collections.abc import Collection, Container, Iterator
from dataclasses import dataclass, field

from schemas.co_train import DIR_KEY, GroupKey, group_key, group_process, own_mib, shared_mib, why_alone, why_alone_now
from schemas.jobs import JobRequest
from schemas.job_status import JobStatus
from schemas.memory import Estimate, ModelShape, estimate
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import Fleet, SlotKey

log = logging.getLogger(__name__)
Bucket = tuple[GroupKey, str, str]  # (what its jobs share, whose jobs it takes: "" for anyone's, device kind)
SCAN = 64  # groups of one bucket looked at for one job at most (past the best fit: kept nodes, other digests)
REASONS = 5  # groups `jetlora why` names at most


def holder(job_id: str, group: str | None) -> str:
    """Who a device is held for: the job's group when it trains in one, else the job."""
    return f"group {group}" if group else job_id


_ids = itertools.count(1)
_THIS_PROCESS = secrets.token_hex(3)  # group ids of different schedulers (and runs of one) never meet


def new_group_id() -> str:
    return f"cg-{_THIS_PROCESS}{next(_ids):x}"


@dataclass
class CoGroup:
    """One co-training group: where it trains, what its jobs share, and who is in it."""

    id: str
    slot: SlotKey
    key: GroupKey
    tenant: str | None  # the tenant of the job that started it (the same-tenant policy admits only its jobs)
    base_mib: int = 0  # what the group holds once (the base, the CUDA context), when the model's shape is known
    members: dict[str, int] = field(default_factory=dict)  # job -> MiB it adds to the group (its own state)
    base_dir: str = ""  # its first job's base, on the group's node: its content digest is looked up by it


class Groups:
    """The groups of the jobs in memory, by id, by device and by node, with the open ones indexed by room."""

    def __init__(self, fleet: Fleet, cfg: SchedulerConfig) -> None:
        self.fleet, self.cfg = fleet, cfg
        self.by_id: dict[str, CoGroup] = {}
        self.by_slot: dict[SlotKey, str] = {}
        self.on_node: dict[str, set[str]] = {}
        self._open: dict[Bucket, list[tuple[int, str]]] = {}  # sorted (room, group) of groups with a place left
        self._filed: dict[str, tuple[Bucket, tuple[int, str]]] = {}  # group -> where it is in _open

    def join(
        self, group: str, slot: SlotKey, job_id: str, request: JobRequest, tenant: str | None, need: int | None = None
    ) -> None:
        """The job holds (or is being placed on) the group's device; the first member makes the group. `need`: what
        it adds there, when the caller knows it (own_need). A member joining again (its placement stored, its state
        moving on) keeps the MiB it was filed with: they count only until its node lists it running."""
        g = self.by_id.get(group)
        if g is not None and job_id in g.members and g.slot == slot:
            return
        if g is None:
            shape = self.fleet.model_shape(request.base_dir, slot[0])
            g = CoGroup(group, slot, group_key(request, shape), tenant, base_need(request, self.fleet, slot))
            g.base_dir = request.base_dir.rstrip("/")
            self.by_id[group] = g
            self.by_slot[slot] = group
            self.on_node.setdefault(slot[0], set()).add(group)
        elif g.slot != slot:
            log.error(
                "job %s joins group %s on %s device %d, but the group trains on %s device %d",
                job_id,
                group,
                *slot,
                *g.slot,
            )
        g.members[job_id] = own_need(request, self.fleet, slot) if need is None else need
        self._file(g)

    def leave(self, group: str, job_id: str) -> bool:
        """The job no longer holds the group's device; True when it was the last (the device goes back)."""
        g = self.by_id.get(group)
        if g is None:
            return True
        g.members.pop(job_id, None)
        if g.members:
            self._file(g)
            return False
        self._unfile(group)
        del self.by_id[group]
        if self.by_slot.get(g.slot) == group:
            del self.by_slot[g.slot]
        on_node = self.on_node.get(g.slot[0], set())
        on_node.discard(group)
        if not on_node:
            self.on_node.pop(g.slot[0], None)
        return True

    def on(self, slot: SlotKey) -> CoGroup | None:
        group = self.by_slot.get(slot)
        return self.by_id.get(group) if group else None

    def node_heard(self, node: str) -> None:
        """The node's heartbeat changed what its devices have free (or that it is gone): its groups are re-filed."""
        groups = self.on_node.get(node)
        if groups:
            seen = _running(self.fleet, node)
            for group in groups:
                g = self.by_id[group]
                self._by_content(g)
                self._file(g, seen)

    def _by_content(self, g: CoGroup) -> None:
        """A group founded before its node had hashed its base (the agent's first heartbeats carry no digest) was
        keyed by the base's directory: keyed by its content once the node says it, or a job on a copy of the base
        elsewhere (and one on the same directory, keyed by the digest by then) would never find it."""
        if g.key[0].startswith(DIR_KEY):
            shape = self.fleet.model_shape(g.base_dir, g.slot[0])
            if shape is not None and shape.digest:
                g.key = (shape.digest, *g.key[1:])

    # --- the index --------------------------------------------------------------------------------
    def _who(self, tenant: str | None) -> str:
        return (tenant or "") if self.cfg.co_train == "same-tenant" else ""

    def _unfile(self, group: str) -> None:
        filed = self._filed.pop(group, None)
        if filed is None:
            return
        bucket, item = filed
        rooms = self._open[bucket]
        i = bisect.bisect_left(rooms, item)
        if i < len(rooms) and rooms[i] == item:
            del rooms[i]
        if not rooms:
            del self._open[bucket]

    def _file(self, g: CoGroup, seen: frozenset[str] | None = None) -> None:
        """File the group by the room its device has now, or take it out while it cannot take anyone (`seen`: the
        jobs its node's last heartbeat lists running, when the caller has them). A group whose room is what it was
        filed by stays where it is: a node's heartbeat re-files each of its groups, mostly to the same place."""
        node, index = g.slot
        view = self.fleet.nodes.get(node)
        dev = view.devices.get(index) if view else None
        if len(g.members) >= self.cfg.co_train_max or view is None or dev is None:
            self._unfile(g.id)
            return
        if view.heartbeat.draining or dev.failed or dev.reclaim_mib:
            self._unfile(g.id)
            return
        seen = _running(self.fleet, node) if seen is None else seen  # their memory is in free_mib
        pending, loaded = 0, False
        for job, mib in g.members.items():
            if job in seen:
                loaded = True
            else:
                pending += mib
        if not loaded:
            pending += g.base_mib  # the group's process has not loaded the base yet
        bucket, item = (g.key, self._who(g.tenant), dev.kind), (dev.free_mib - pending, g.id)
        if self._filed.get(g.id) == (bucket, item):
            return
        self._unfile(g.id)
        bisect.insort(self._open.setdefault(bucket, []), item)
        self._filed[g.id] = (bucket, item)

    def best_fit(
        self, request: JobRequest, tenant: str | None, kept: Container[str] = ()
    ) -> tuple[CoGroup, int] | None:
        """The open group the job fits best (least room left once it joins), with the MiB it needs free there; on
        no node in `kept`."""
        fleet, who, kinds = self.fleet, self._who(tenant), self.fleet.kinds(request.accelerator)
        if request.node is not None:  # the node's few groups
            filed = [self._filed[g] for g in self.on_node.get(request.node, ()) if g in self._filed]
            lists = [sorted(item for bucket, item in filed if bucket[1:] == (who, kind)) for kind in kinds]
        else:
            key = group_key(request, fleet.model_shape(request.base_dir))
            lists = [self._open.get((key, who, kind), []) for kind in kinds]
        best: tuple[int, CoGroup, int] | None = None
        for rooms in filter(None, lists):
            i = bisect.bisect_left(rooms, (own_need(request, fleet, self.by_id[rooms[0][1]].slot), ""))
            for room, group in rooms[i : i + SCAN]:  # a slice: islice would step over the i groups before it
                g = self.by_id[group]
                if g.slot[0] in kept:
                    continue
                shape = fleet.model_shape(request.base_dir, g.slot[0])  # looked up once for both questions
                need = _own_need(request, fleet, g.slot, shape)
                if room < need:
                    continue
                if group_key(request, shape) != g.key:
                    continue  # this node's copy of the base is another
                if best is None or room - need < best[0]:
                    best = (room - need, g, need)
                break  # the first that takes it is this kind's best fit
        return (best[1], best[2]) if best else None


class EitherNodes(Collection[str]):
    """The nodes in either of two live views (with a free device; with a co-training group), their union never
    built: a placement pass asks it only about the nodes jobs are pinned to, and the union of the two views cost
    ~20 us a pass at 1,000 nodes, thousands of passes a second in a burst."""

    def __init__(self, first: Collection[str], second: Collection[str]) -> None:
        self.first, self.second = first, second

    def __contains__(self, node: object) -> bool:
        return node in self.first or node in self.second

    def __iter__(self) -> Iterator[str]:
        yield from self.first
        yield from (node for node in self.second if node not in self.first)

    def __len__(self) -> int:
        """At most the count (a node may be in both): what JobQueue.pinned_nodes needs to walk the smaller side,
        at no cost."""
        return len(self.first) + len(self.second)


def _running(fleet: Fleet, node: str) -> frozenset[str]:
    """The jobs the node's last heartbeat lists running."""
    view = fleet.nodes.get(node)
    return view.running if view else frozenset()


def _estimate(request: JobRequest, fleet: Fleet, slot: SlotKey, shape: ModelShape | None) -> Estimate | None:
    """The job's estimate on `slot`, given the shape the slot's node advertises for its base (None: unknown)."""
    if shape is None:
        return None
    view = fleet.nodes.get(slot[0])
    dev = view.devices.get(slot[1]) if view else None
    return None if dev is None else estimate(shape, request, dev.kind)


def own_need(request: JobRequest, fleet: Fleet, slot: SlotKey) -> int:
    """MiB a job adds to a group on `slot`: its estimate less the base and the CUDA context (the group holds those
    once); its whole gpu_mib when the node does not advertise the model's shape."""
    return _own_need(request, fleet, slot, fleet.model_shape(request.base_dir, slot[0]))


def _own_need(request: JobRequest, fleet: Fleet, slot: SlotKey, shape: ModelShape | None) -> int:
    need = _estimate(request, fleet, slot, shape)
    return request.gpu_mib if need is None else own_mib(need)


def base_need(request: JobRequest, fleet: Fleet, slot: SlotKey) -> int:
    """MiB a group started by this job holds once: its base weights and the CUDA context (0 when unknown: its first
    job's gpu_mib stands for all of it)."""
    need = _estimate(request, fleet, slot, fleet.model_shape(request.base_dir, slot[0]))
    return 0 if need is None else shared_mib(need)


def may_co_train(cfg: SchedulerConfig, request: JobRequest) -> bool:
    """Whether the policy and the job let it train in one process with others at all."""
    return cfg.co_train != "off" and why_alone(request) is None


def find_group(
    groups: Groups,
    cfg: SchedulerConfig,
    request: JobRequest,
    tenant: str | None,
    kept: Container[str] = (),
    alone: str = "",
) -> tuple[CoGroup, int] | None:
    """A running group the job may join now, with the MiB it needs free there: the same base weights, precision
    and quantisation, the policy's tenants, a place left, and room on the device beyond what members placed since
    the node's last heartbeat will take; on no node in `kept`. The fullest such group first (best fit). `alone`: why
    the job trains alone since it left a group (JobStatus.train_alone)."""
    if alone or not groups.by_id or not may_co_train(cfg, request):
        return None
    return groups.best_fit(request, tenant, kept)


FounderKey = tuple[str, str, str, int, str, str, str]


def founder_key(cfg: SchedulerConfig, request: JobRequest, tenant: str | None) -> FounderKey | None:
    """What queued jobs that could start a group together share (None: the job trains alone): the base directory,
    precision, quantisation, priority (the yield rule), accelerator, the group's process (sessions or training jobs)
    and, under the same-tenant policy, the tenant. A job queued with others of its key starts a group when placed on
    a free device; one with nobody to share with trains alone, as it always has (a session starts one even alone:
    schemas/co_train.py founds_alone)."""
    if not may_co_train(cfg, request):
        return None
    who = (tenant or "") if cfg.co_train == "same-tenant" else ""
    base = request.base_dir.rstrip("/")
    kind = group_process(request)
    return (base, request.train.precision, request.quantization, request.priority, request.accelerator, who, kind)


def co_train_note(
    groups: Groups, cfg: SchedulerConfig, request: JobRequest, tenant: str | None, status: JobStatus
) -> str:
    """For `jetlora why` of a queued job: whether it may co-train, and why no running group takes it now (the first
    few groups of its kind)."""
    if cfg.co_train == "off":
        return ""
    if (alone := why_alone_now(request, status)) is not None:
        return f"; it trains alone: {alone}"
    fleet, reasons = groups.fleet, []
    for g in groups.by_id.values():
        node, index = g.slot
        if group_key(request, fleet.model_shape(request.base_dir, node)) != g.key:
            continue
        if cfg.co_train == "same-tenant" and tenant != g.tenant:
            reasons.append(f"group {g.id} on {node} is another tenant's (--co-train {cfg.co_train})")
        elif len(g.members) >= cfg.co_train_max:
            reasons.append(f"group {g.id} on {node} is full ({len(g.members)} jobs, --co-train-max)")
        else:
            view = fleet.nodes.get(node)
            dev = view.devices.get(index) if view else None
            free = dev.free_mib if dev else 0
            reasons.append(
                f"group {g.id} on {node} device {index} has {free:,} MiB free, the job would add "
                f"{own_need(request, fleet, g.slot):,}"
            )
        if len(reasons) >= REASONS:
            reasons.append(f"(of {len(groups.by_id):,} groups)")
            break
    return "; " + "; ".join(reasons) if reasons else ""
