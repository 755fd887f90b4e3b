"""A job as the scheduler keeps it and answers about it: its states, its stored request and status (the jobs bucket's
values), its artifacts and checkpoints, a summary for listing, the queries that ask about it, a submission key's
record. What a submitter sends is schemas/jobs.py."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from msgspec import Meta, Struct, field

from schemas.jobs import JobId, JobRequest, NodeId, TenantId
from schemas.parity import ParityText

ActiveState = Literal["assigned", "preparing", "running", "uploading"]  # the job holds a device
TerminalState = Literal["succeeded", "failed", "cancelled", "stopped"]  # the job ended; nothing changes it again
JobState = Literal["queued", "paused", ActiveState, TerminalState]  # paused: holds no device, waits for resume
ACTIVE_STATES: frozenset[str] = frozenset(get_args(ActiveState))
TERMINAL_STATES: frozenset[str] = frozenset(get_args(TerminalState))


PROBE_PROMPT = "Hello"  # what a trained adapter is asked, greedily, to fingerprint it (trainer and engines alike)
PROBE_TOKENS = 8  # how many tokens it answers
PROBE_HEAD_TOKENS = 4  # where precisions differ (bf16 engine, fp32 trainer), at least this many must agree


class Probe(Struct, kw_only=True):
    """A trained adapter's greedy answer to PROBE_PROMPT, as its trainer computed it: an engine that serves this
    adapter answers the same (exactly at the same precision; its first PROBE_HEAD_TOKENS tokens where it differs)."""

    prompt: str
    text: str  # the greedy continuation, at most PROBE_TOKENS tokens, decoded without special tokens
    head: str  # its first PROBE_HEAD_TOKENS tokens, decoded
    dtype: str  # the precision the trainer ran in, e.g. "float32", "bfloat16"
    parity: list[ParityText] | None = None  # the probe set's log-probabilities (schemas/parity.py); None: older


class ArtifactRef(Struct):
    """Where one of a job's artifacts lies in the object store."""

    kind: str
    name: str
    size: int
    sha256: str
    probe: Probe | None = None  # the PEFT adapter's fingerprint


class StoredRequest(Struct, kw_only=True):
    """A submitted job as kept in the jobs KV bucket under `request.<id>`: written once, never changed."""

    id: JobId
    request: JobRequest
    created: float
    seq: int = 0  # submission order among equal priorities
    tenant: TenantId | None = None  # from the subject it was submitted on; None: an admin's submission
    index_seq: int = 0  # its entry in the job index (submission order); 0: stored before the index existed


class CheckpointInfo(Struct, kw_only=True):
    """A checkpoint of a job: where it is stored, and how the run stood when it was taken."""

    step: int
    name: str  # object-store name (jetlora artifacts get)
    loss: float | None = None  # train loss of the steps logged last
    eval_loss: float | None = None  # the latest evaluation's
    created: float = 0.0
    eval_reward: float | None = None  # grpo: the latest evaluation's mean reward


PAUSES_KEPT = 16  # JobStatus.paused_attempts: the latest this many
PAUSED_RUNS_KEPT = 64  # JobStatus.paused_runs: the latest this many (a run ends at an attempt not ended in a pause)
PausedRun = tuple[int, int]  # the first and last of consecutive attempts that each ended in a pause


def with_pause(runs: list[PausedRun], attempt: int) -> list[PausedRun]:
    """`runs` with `attempt` ended in a pause: the last run grows when `attempt` follows it (pauses with nothing else
    between take one run however many), else `attempt` starts a run of its own."""
    if runs and runs[-1][0] <= attempt <= runs[-1][1]:
        return runs  # told again
    if runs and runs[-1][1] == attempt - 1:
        return [*runs[:-1], (runs[-1][0], attempt)]
    return [*runs, (attempt, attempt)][-PAUSED_RUNS_KEPT:]


def ended_in_pause(runs: list[PausedRun], attempt: int) -> bool:
    """Whether `attempt` ended in a pause. One the runs do not cover did not, or ended before the oldest run kept:
    not known to have kept its calls, so taken as lost (a loss told falsely costs a redo; one kept silent, the run)."""
    return any(first <= attempt <= last for first, last in runs)


class JobStatus(Struct, kw_only=True):
    """Where a job stands, kept under `status.<id>`; no key yet means queued since submission."""

    state: JobState = "queued"
    message: str = ""
    updated: float = 0.0
    node: NodeId | None = None
    device: int | None = None  # the job's first (rank 0's) device
    devices: list[int] = field(default_factory=list)  # all of them, for a job on several; else empty
    group: str | None = None  # the co-training group its attempt trains in (one process on the device); None: alone
    attempt: int = 0  # assignments so far; agents' state events name theirs, so stale ones are ignored
    held_by: list[NodeId] = field(default_factory=list)  # the node of each attempt, oldest first: whose events count
    event_seq: int = 0  # the JOBS stream sequence of the last state event applied: an older one redelivered is stale
    retries_used: int = 0  # times the job was re-queued because its node went away
    paused_attempts: list[int] = field(default_factory=list)  # its attempts that ended in a pause (the latest few):
    # each saved all it had done (a Tinker session: every call answered), so the next attempt lost nothing of it
    paused_runs: list[PausedRun] = field(default_factory=list)  # the same as runs (with_pause): any number of pauses
    # in a row take one, so only an attempt that ended otherwise (a node lost, an agent shut down) starts the next;
    # what a Tinker gateway judges a session's loss by (ended_in_pause)
    train_alone: str = ""  # why it trains alone from now on (split out of a co-training group); "": as it asks
    artifacts: list[ArtifactRef] = field(default_factory=list)
    checkpoint: str | None = None  # object-store name of the latest checkpoint: a re-queued job resumes from it
    checkpoints: list[CheckpointInfo] = field(default_factory=list)  # those stored, oldest first
    paused_by: str | None = None  # "user", or the node and device whose serving engine wanted its memory back
    preempted: str = ""  # who preempted it and why, while it waits to go on from its checkpoint (cleared when placed)
    preempted_at: float = 0.0  # when it was last preempted (wall clock): it is not preempted again within a backoff
    step: int = 0
    steps: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    peak_mib: float | None = None


class JobSummary(Struct, kw_only=True):
    """A job in a listing: its record without the training data."""

    id: JobId
    tenant: TenantId | None
    label: str
    model: str
    state: JobState
    message: str
    node: NodeId | None
    device: int | None
    priority: int
    gpu_mib: int
    created: float
    updated: float
    attempt: int
    step: int
    steps: int
    loss: float | None
    artifacts: list[ArtifactRef]
    paused_by: str | None = None
    devices: list[int] = field(default_factory=list)  # a job on several devices: all of them
    group: str | None = None  # the co-training group it trains (or trained) in
    preempted: str = ""  # queued again after a preemption: who preempted it and why (it goes on from its checkpoint)
    paused_attempts: list[int] = field(default_factory=list)  # its attempts that ended in a pause (the latest few)
    paused_runs: list[PausedRun] = field(default_factory=list)  # the same, as runs (JobStatus.paused_runs)


def summarize(stored: StoredRequest, status: JobStatus) -> "JobSummary":
    req = stored.request
    return JobSummary(
        id=stored.id,
        tenant=stored.tenant,
        label=req.label,
        model=req.model,
        state=status.state,
        message=status.message,
        node=status.node,
        device=status.device,
        priority=req.priority,
        gpu_mib=req.gpu_mib,
        created=stored.created,
        updated=status.updated or stored.created,
        attempt=status.attempt,
        step=status.step,
        steps=status.steps,
        loss=status.loss,
        artifacts=status.artifacts,
        paused_by=status.paused_by,
        devices=status.devices,
        group=status.group,
        paused_attempts=status.paused_attempts,
        paused_runs=status.paused_runs,
        preempted=status.preempted,
    )


class JobQuery(Struct, forbid_unknown_fields=True):
    """Ask for one job (get, cancel, stop)."""

    job: JobId


class JobListQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    """A page of jobs, newest first. `after`: the `next` of the page before (with the same filters): the page then
    holds the jobs older than those, so jobs submitted meanwhile never shift it."""

    state: JobState | None = None
    node: NodeId | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100
    after: Annotated[int, Meta(ge=0)] | None = None


class JobReply(Struct, tag="job", tag_field="type"):
    job: JobSummary


class NodeWhy(Struct, kw_only=True):
    node: NodeId
    reason: str  # "fits", "busy", "no GPU", "insufficient free memory", "draining", ...


class JobWhy(Struct, tag="why", tag_field="type", kw_only=True):
    """Why a job waits (`jetlora why JOB`): the summary its message shows, and each node's reason."""

    job: JobId
    state: JobState
    summary: str
    nodes: list[NodeWhy] = field(default_factory=list)


class JobList(Struct, tag="jobs", tag_field="type"):
    jobs: list[JobSummary]  # newest first
    next: int | None = None  # the `after` of the next page; None: this was the last


class IdempotencyRecord(Struct, kw_only=True):
    """Kept under `idem.<sha256 of the key>` in the jobs bucket: which job a submitter's key made, from what."""

    job: JobId
    request_sha256: str  # of the request as decoded, so the same job sent again matches whatever its formatting
    created: float
    index_seq: int = 0  # the job's "submitted" index entry, once a try wrote it (a retry writes no second one)
