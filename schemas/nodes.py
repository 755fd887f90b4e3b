"""What node agents tell the scheduler, and what the scheduler tells them."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from schemas.jobs import JobId, JobRequest, NodeId, TenantId
from schemas.job_status import JobState
from schemas.memory import ModelShape

CPU_DEVICE = -1  # the index of a node's CPU when it offers it for training


def on_devices(indices: list[int]) -> str:
    """How messages name where a job runs: "device 0", or "devices 0, 1"."""
    return f"devices {', '.join(map(str, indices))}" if len(indices) > 1 else f"device {indices[0]}"


class Device(Struct, kw_only=True):
    """One GPU of a node (or its CPU, index -1, when the node offers it)."""

    index: int
    kind: Literal["cuda", "cpu"] = "cuda"
    name: str = ""
    total_mib: Annotated[int, Meta(ge=0)]
    free_mib: Annotated[int, Meta(ge=0)]
    utilization: Annotated[int, Meta(ge=0, le=100)] | None = None
    jobs: list[str] = field(default_factory=list)  # jetlora jobs running on it
    reclaim_mib: Annotated[int, Meta(ge=0)] = 0  # the serving engine here wants this much back: nothing new is placed
    failed: str = ""  # why the device cannot be read (fallen off the bus): nothing is placed on it


class EngineLoad(Struct, kw_only=True):
    """What a serving engine on the node is doing, from its own metrics, as the agent last read them."""

    engine: str  # its label: kind and address
    devices: list[int] = field(default_factory=list)  # the devices it serves on (training there yields to it)
    running: int = 0  # requests being served
    waiting: int = 0  # requests queued
    kv_usage: Annotated[float, Meta(ge=0, le=1)] | None = None  # fraction of its KV cache in use
    busy_fraction: Annotated[float, Meta(ge=0, le=1)] = 0.0  # of the recent polls, how many found it serving
    error: str = ""  # why its metrics could not be read (then nothing is guessed)


class RunningAttempt(Struct, kw_only=True):
    """One attempt of a job that a node runs now. The scheduler ends every attempt it does not recognise (an
    older one, one of a job that ended or went elsewhere), and takes back one it gave up on while the node was
    silent if the job is still waiting."""

    job: JobId
    attempt: int
    devices: list[int]  # rank 0's first
    state: JobState  # as the node last reported it: preparing, running or uploading
    group: str | None = None  # the co-training group it trains in (one process with the group's other jobs)


class Heartbeat(Struct, kw_only=True):
    """An agent's periodic word that it is alive, and what its devices have free."""

    node: NodeId
    agent_version: str
    devices: list[Device]
    offers_cpu: bool = False
    no_gpu_reason: str = ""
    running: list[str] = field(default_factory=list)
    attempts: list[RunningAttempt] = field(default_factory=list)  # what `running` runs: which attempt, where
    finished: list[str] = field(default_factory=list)  # jobs that ended in the last minute
    interval_s: float = 1.0
    sent_at: float = 0.0
    draining: bool = False
    models: list[ModelShape] = field(default_factory=list)  # base models here, to size `gpu_mib: 0` jobs by
    engines: list[EngineLoad] = field(default_factory=list)  # its serving engines' load: placement prefers idle ones


class Assignment(Struct, kw_only=True):
    """The scheduler asks a node to run a job on one of its devices."""

    job: JobId
    device: int
    devices: list[int] = field(default_factory=list)  # a job on several devices: all of them, rank order
    attempt: int
    request: JobRequest
    resume_from: str | None = None  # object-store name of a checkpoint
    tenant: TenantId | None = None  # whose job it is: its artifacts are recorded as that tenant's
    engine_priority: int | None = None  # its priority against serving engines (--engine-yield exempt=P), the
    # scheduler's to give: an admin's job's own priority; None: it always yields (a tenant's, whatever it asked for)
    group: str | None = None  # co-train it in this group: one trainer process on the device for the group's jobs,
    # sharing the base model (the node starts it with the first, the next join it); None: a trainer of its own
    need_mib: int | None = None  # free memory the device must have for it: a job joining a running group adds only
    # its own adapter, optimizer and activations to what the group holds; None: request.gpu_mib
    term: int = 0  # the sending scheduler's term: a node refuses it once it has seen a newer one (0: none)

    @property
    def ranks(self) -> list[int]:
        """The devices the job's ranks run on, rank 0's first."""
        return self.devices or [self.device]


class AssignAccepted(Struct, tag="accepted", tag_field="type"):
    job: JobId


class AssignRefused(Struct, tag="refused", tag_field="type"):
    job: JobId | None  # None: the assignment itself did not decode
    reason: str


AssignReply = AssignAccepted | AssignRefused


class Control(Struct, forbid_unknown_fields=True):
    """Cancel a job (kill it), stop it (save what it has learnt and end) or pause it (checkpoint and free the
    device, to be resumed later); or end an attempt the scheduler does not recognise (kill it, report and store
    nothing: another attempt, or nothing, is the job's now)."""

    job: JobId
    action: Literal["cancel", "stop", "pause", "end"]
    by: str = ""  # a pause's reason, reported back with the paused state: "user", or the engine that wanted memory
    attempt: int = 0  # the attempt it is meant for (a node refuses it for another); 0: whichever runs
    term: int = 0  # the sending scheduler's term: a node refuses it once it has seen a newer one (0: none)


class Reclaim(Struct, forbid_unknown_fields=True, kw_only=True):
    """A serving engine wants memory of its device back (mib > 0), or no longer does (mib 0)."""

    device: int
    mib: Annotated[int, Meta(ge=0, description="MiB the engine wants back; 0: it no longer needs any")]


class ReclaimReply(Struct):
    ok: bool
    message: str = ""


class ControlReply(Struct):
    job: JobId | None  # None: the request itself did not decode
    ok: bool
    message: str = ""


class NodeInfo(Struct, kw_only=True):
    """A node as the scheduler sees it."""

    node: NodeId
    alive: bool
    last_seen: float
    agent_version: str
    devices: list[Device]
    offers_cpu: bool
    no_gpu_reason: str
    running: list[str]
    engines: list[EngineLoad] = field(default_factory=list)
    attempts: list[RunningAttempt] = field(default_factory=list)  # what runs there: each job's attempt and group


class NodeList(Struct, tag="nodes", tag_field="type"):
    nodes: list[NodeInfo]
