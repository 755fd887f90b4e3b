"""Job events: what the JOBS stream carries, and what the trainer prints on stdout."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from schemas.jobs import JobId, JobRequest, NodeId
from schemas.job_status import ArtifactRef, CheckpointInfo, JobState, Probe


class PreferenceMetrics(Struct, kw_only=True):
    """A dpo job's figures over the logged steps' pairs: beta x log-ratio to the reference for each side."""

    rewards_chosen: float
    rewards_rejected: float
    margin: float  # chosen minus rejected
    accuracy: float  # the fraction of pairs where the chosen answer's reward is the higher


class RewardStats(Struct, kw_only=True):
    mean: float
    std: float


class ReinforcementMetrics(Struct, kw_only=True):
    """A grpo job's figures over the logged steps' completions (sampled by the adapter, scored by the grader)."""

    reward: float  # the completions' mean score
    reward_std: float
    graders: dict[str, RewardStats] = field(default_factory=dict)  # by name: the grader's, a multi grader's parts
    pass_rate: float  # the share scoring at least the grader's pass threshold (above 0.5 where it has none)
    kl: float | None = None  # per completion token, against the reference (grpo_beta > 0)
    completion_tokens: float  # the completions' mean length
    rollouts_per_s: float  # completions sampled and graded per second of doing so
    grading_failures: int = 0  # completions the grader failed on (scored 0)
    sampled_by: Literal["trainer", "engine", "both"] = "trainer"  # who sampled the window's completions
    sampled_from: list[int] = field(default_factory=list)  # the adapter versions (optimizer steps taken) they were
    # sampled from: a step's completions are its adapter's before the step, so step s learns from version s - 1
    sync_s: float | None = None  # engine rollouts: mean seconds per sync (save, load into the engine, probe confirmed)
    syncs: int = 0  # syncs in the window
    stale_rollouts: int = 0  # engine completions dropped: the engine no longer served their version after sampling
    stale_share: float | None = None  # stale / all the engine sampled in the window (None: the engine sampled none)
    fallback_rollouts: int = 0  # completions the trainer sampled because the engine failed or stayed stale


class Progress(Struct, tag="progress", tag_field="type", kw_only=True):
    """One logging step of training (the fields of both seeds' progress)."""

    job: JobId | None = None  # set by the agent when it publishes
    step: int
    steps: int
    epoch: float = 0.0
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens: int = 0  # real (unpadded) tokens seen so far
    tokens_per_s: float | None = None
    elapsed_s: float = 0.0
    eta_s: float | None = None
    peak_mib: float | None = None  # CUDA: max allocated; CPU: peak RSS
    eval_loss: float | None = None
    message: str = ""
    ts: float = 0.0
    preference: PreferenceMetrics | None = None  # dpo jobs
    reinforcement: ReinforcementMetrics | None = None  # grpo jobs
    eval_reward: float | None = None  # grpo: the latest evaluation's mean reward on held-out prompts


class StateChange(Struct, tag="state", tag_field="type", kw_only=True):
    """A job moved to a new state (agents report these; the scheduler applies them)."""

    job: JobId
    state: JobState
    node: NodeId
    attempt: int = 0
    message: str = ""
    artifacts: list[ArtifactRef] = field(default_factory=list)
    ts: float = 0.0
    paused_by: str | None = None  # with `paused`: who asked (see Control.by)
    checkpoint: CheckpointInfo | None = None  # a checkpoint was stored: a resumed or re-queued job goes on from it
    train_alone: str = ""  # with `queued`: why the job trains alone from now on (it left a co-training group)


class DataFile(Struct, kw_only=True):
    """A dataset the agent fetched for the trainer: a checked JSON-lines file on local disk."""

    path: str
    sha256: str
    format: str
    rows: int


RENDEZVOUS_ENV = "JETLORA_RENDEZVOUS"  # the file through which a multi-device job's ranks meet (torch's FileStore)
ENGINE_WAIT = "engine-wait"  # a file in the trainer's out_dir while it waits on its rollout engine (computing nothing)


class RolloutEngine(Struct, kw_only=True):
    """The node's vLLM a grpo job samples its completions through (the agent's --engine vllm=URL of the job's base
    model)."""

    url: str  # its OpenAI-compatible API: /v1/completions, /v1/load_lora_adapter, /v1/unload_lora_adapter
    priority: int = 0  # rollouts' request priority (vLLM --scheduling-policy priority: larger is later); 0: none


class TrainerSpec(Struct, kw_only=True):
    """The file the agent writes for `python -m trainer JOB.json`."""

    job: JobId
    attempt: int
    request: "JobRequest"
    out_dir: str
    device: str = "cpu"  # "cuda" (the card is chosen by CUDA_VISIBLE_DEVICES) or "cpu"
    resume_from: str | None = None  # a checkpoint directory
    dataset: DataFile | None = None  # request.dataset, fetched
    validation: DataFile | None = None  # request.validation_dataset, fetched
    token_cache: str | None = None  # where tokenized datasets are kept between jobs; None: in out_dir
    init_adapter: str | None = None  # request.init_adapter's PEFT directory, fetched
    rollout_engine: RolloutEngine | None = None  # grpo with train.rollouts engine or auto: the node's vLLM
    no_rollout_engine: str = ""  # why the node offers none (train.rollouts engine fails with it; auto: the trainer)
    base_digest: str = ""  # co-trained: request.base_dir's content digest as the agent hashed it (a group's process
    # takes a joiner only with its own base's; "": the process hashes it itself)


class Preparing(Struct, tag="preparing", tag_field="type", kw_only=True):
    """Before the first step: how far the data's preparation is (tokenizing a large file takes minutes)."""

    job: JobId | None = None  # set by the agent when it publishes
    done: int
    total: int
    message: str
    ts: float = 0.0


# What the trainer subprocess prints, one JSON object per line.
class Started(Struct, tag="started", tag_field="type", kw_only=True):
    steps: int
    examples: int
    eval_examples: int = 0
    device: str = "cpu"
    message: str = ""


class Checkpoint(Struct, tag="checkpoint", tag_field="type", kw_only=True):
    step: int
    path: str


class Finished(Struct, tag="finished", tag_field="type", kw_only=True):
    """Training ended: `trained` ran to the end (or stopped early on its eval loss), `stopped` was asked to stop
    and saved its adapter, `paused` saved a checkpoint to go on from (adapter_dir is then that checkpoint's)."""

    state: Literal["trained", "stopped", "paused"]
    step: int
    adapter_dir: str
    gguf_path: str | None = None
    message: str = ""
    best_step: int | None = None  # keep_best: the step whose adapter this is
    best_eval_loss: float | None = None
    best_eval_reward: float | None = None  # grpo's keep_best: the best evaluation's mean reward
    probe: Probe | None = None  # the adapter's greedy answer to PROBE_PROMPT (trained or stopped, not paused)


class Failed(Struct, tag="failed", tag_field="type", kw_only=True):
    message: str


class Cancelled(Struct, tag="cancelled", tag_field="type", kw_only=True):
    """Not printed by the trainer: how the agent's runner ends a trainer it killed on request."""

    message: str = "cancelled"


class Sample(Struct):
    prompt: str
    answer: str
    score: float | None = None  # grpo: the grader's score of the answer


class Samples(Struct, tag="samples", tag_field="type", kw_only=True):
    """Greedy answers to the job's sample prompts: by the adapter at an evaluation, or once by the base model
    (grpo: held-out prompts' answers at an evaluation, with their scores)."""

    job: JobId | None = None  # set by the agent when it publishes
    step: int
    model: Literal["adapter", "base"]
    samples: list[Sample]
    ts: float = 0.0


JobEvent = Progress | StateChange | Preparing | Samples
TrainerEvent = Started | Preparing | Progress | Samples | Checkpoint | Finished | Failed


class Requeue(Struct, tag="requeue", tag_field="type", kw_only=True):
    """A co-trained job leaves its group to train alone (the group's shared step ran out of memory with it in): the
    checkpoint it printed just before is where it goes on from; the agent hands it back to the queue, saying why."""

    step: int
    message: str
    checkpoint: str = ""  # the checkpoint it printed for this (the agent stores it first); "": none newer than its last


class GroupControl(Struct, forbid_unknown_fields=True, kw_only=True):
    """A line the agent writes to a co-training group's trainer (`python -m trainer.co_train DIR`) on its stdin:
    a job joins (`spec`: its TrainerSpec, as a trainer alone is given it), or one of its jobs is cancelled
    (dropped at once), stopped (its adapter saved) or paused (a checkpoint to resume from), each after the step
    under way; held (it yields to a serving engine: it takes no step until `go`) or let go on. Each names the
    attempt it is for (0: whichever is there): a line for an attempt the group no longer holds is left. The group
    ends once its stdin is closed and no job is left in it."""

    action: Literal["add", "cancel", "stop", "pause", "hold", "go"]
    job: JobId
    spec: TrainerSpec | None = None  # with `add`
    attempt: int = 0


class GroupEvent(Struct, kw_only=True):
    """A line a co-training group's trainer prints on stdout: one of its jobs' events, as a trainer alone prints
    it, with the attempt it belongs to (the agent drops a superseded attempt's); a job's Finished, Failed or
    Requeue is its last."""

    job: JobId
    event: TrainerEvent | Requeue
    attempt: int = 0


class EventsQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    """A page of one job's events, oldest first: those after stream sequence `after` (0: from the start)."""

    job: JobId
    after: Annotated[int, Meta(ge=0, description="the `next` of the previous page; 0: from the first event")] = 0
    after_step: Annotated[int, Meta(ge=0, description="leave out progress and samples up to this step")] | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100


class EventEntry(Struct, kw_only=True):
    seq: int  # the event's sequence in the JOBS stream
    event: JobEvent
    node: str = ""  # who sent it: a node that held one of the job's attempts (no one else's events are shown)


class EventPage(Struct, tag="events", tag_field="type", kw_only=True):
    job: JobId
    events: list[EventEntry]
    next: int  # pass as `after` for the next page
    more: bool  # whether the stream held more of the job's events when this page was read


class CheckpointList(Struct, tag="checkpoints", tag_field="type", kw_only=True):
    job: JobId
    checkpoints: list[CheckpointInfo]
