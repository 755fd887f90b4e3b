"""Training sessions: a job (`train.method: "session"`) whose trainer stays up and takes calls one at a time, the
Tinker API's training client on jetlora's fleet. The gateway sends a SessionRequest to the node that runs the job
(names.node(node).session, request/reply); the agent hands the call to the job's trainer on its stdin and answers
with what the trainer printed back (a SessionAnswer line beside its events).

Calls act on one LoRA adapter of a frozen base: forward (and backward: gradients add up until the next optim_step),
an optimizer step, saving and loading its weights, sampling. Tensors travel as plain lists; a call's error names
the field at fault.

Sessions of one base (and tenant, by default) live as members of one process, a session group (trainer/
session_group.py): the agent writes a MemberCall line on its stdin, beside the co-training group's GroupControl
lines, and reads a MemberAnswer line beside its GroupEvent lines.

The words, used so everywhere: a *client session* is Tinker's (create_session; the gateway's SessionRecord,
schemas/tinker_store.py), which holds models; each training model, and each base model's sampler, is a *training
session*: a job of train.method session, what this module is about. Its trainer is trainer.session.serve.Session when
alone, trainer.session.member.SessionMember in a *session group*; the agent runs it as session_run.SessionRun or
group_run.GroupedSession, and its SessionDesk hands each call to whichever it is."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
UNEMBED = ["lm_head"]
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
CLIPS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
# Each loss's loss_fn_config keys and their defaults (trainer/session/losses.py says what each loss computes).
LOSS_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": CLIPS,
    "cispo": CLIPS,
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},  # the GSPO paper's ranges
    "stable_reinforce": {"clip_high_threshold": 2.0, "kl_coeff": 0.0},
}
# Inputs of stable_reinforce the gateway fills from the provenance a datum names (a client never sends them): the
# log-probabilities the sampler recorded for each sampled token, and which tokens were sampled.
RECORDED_LOGPROBS, SAMPLED_MASK = "recorded_logprobs", "sampled_mask"
SNAPSHOTS_KEPT = 4  # unnamed sampler saves (save_weights_and_get_sampling_client) a session keeps in memory
STORED_SAMPLERS = "sampler_saves"  # named sampler saves, under the trainer's out_dir (stored_sampler)
SEED = Annotated[int, Meta(ge=0, le=2**63 - 1)]
SAVED_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a name the client gives a save (one segment of a tinker:// path)
STORED_NAME = r"^(_export-)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a save's name on the node: a client's, or an export's
BASE_WEIGHTS = "__base__"  # Sample.weights: the base model alone (the adapter off); no saved name looks like it


class SessionStart(Struct, forbid_unknown_fields=True, kw_only=True):
    """A session that starts from a state another session of the tenant saved (Tinker's
    create_training_client_from_state): the save `name` in that job's latest checkpoint."""

    job: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    name: Annotated[str, Meta(pattern=SAVED_NAME)]  # the save_state
    step: Annotated[int, Meta(ge=0)]  # the step it was saved at
    optimizer: bool = True  # its optimizer's state too; False: the adapter alone, the optimizer fresh
    checkpoint: str | None = None  # set by the scheduler: that job's latest stored checkpoint (it holds every save)


class SessionSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """The adapter a session trains (Tinker's LoraConfig) and how long it may sit idle."""

    rank: Annotated[int, Meta(ge=1, le=256)] = 32
    seed: SEED | None = None  # the adapter's initial weights (the same seed: the same adapter)
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    idle_s: Annotated[float, Meta(ge=10, le=7 * 86400)] = 900.0  # no call this long: checkpointed, its device freed
    start_from: SessionStart | None = None

    def target_modules(self) -> list[str]:
        return (
            (ATTENTION if self.train_attn else [])
            + (MLP if self.train_mlp else [])
            + (UNEMBED if self.train_unembed else [])
        )


class Datum(Struct, kw_only=True):
    """One sequence: its input tokens and the loss's inputs, each as long as the tokens (position i's target is
    what follows token i)."""

    tokens: list[int]
    inputs: dict[str, list[float]]  # target_tokens (as numbers), weights, logprobs, advantages


class ForwardBackward(Struct, tag="forward_backward", tag_field="type", kw_only=True):
    data: list[Datum]
    loss_fn: str
    config: dict[str, float] = field(default_factory=dict)  # ppo, cispo: clip_low/high_threshold; dro: beta
    forward_only: bool = False


class OptimStep(Struct, tag="optim_step", tag_field="type", kw_only=True):
    """AdamW on the gradients summed since the last step (Tinker's AdamParams)."""

    learning_rate: Annotated[float, Meta(gt=0, le=1)] = 1e-4
    beta1: Annotated[float, Meta(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Meta(ge=0, lt=1)] = 0.95
    eps: Annotated[float, Meta(gt=0, le=1)] = 1e-12
    weight_decay: Annotated[float, Meta(ge=0, le=1e3)] = 0.0  # a finite number (a gateway refuses infinity)
    grad_clip_norm: Annotated[float, Meta(ge=0, le=1e9)] = 0.0  # 0: none


class SaveWeights(Struct, tag="save", tag_field="type", kw_only=True):
    """state: the adapter and the optimizer (to go on from); sampler: the adapter alone (to sample from, or to
    register). A sampler save that is `stored` (a named one) goes to the object store, not the session's memory or
    checkpoint: the trainer writes it under stored_sampler(out_dir, name) and the agent uploads it (SavedResult
    names the object)."""

    name: Annotated[str, Meta(pattern=STORED_NAME)]
    kind: Literal["state", "sampler"]
    stored: bool = False


class LoadWeights(Struct, tag="load", tag_field="type", kw_only=True):
    """A state this session saved: its adapter, and its optimizer when asked."""

    name: Annotated[str, Meta(pattern=SAVED_NAME)]
    optimizer: bool = False


class ChatTurn(Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "developer"]
    content: str


class Sample(Struct, tag="sample", tag_field="type", kw_only=True):
    prompt: list[int]
    num_samples: Annotated[int, Meta(ge=1, le=256)] = 1
    max_tokens: Annotated[int, Meta(ge=1, le=8192)] = 64
    temperature: Annotated[float, Meta(ge=0, le=1e4)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] = -1  # -1: all
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    seed: SEED | None = None
    stop_tokens: list[int] = field(default_factory=list)  # besides the end of sequence
    stop_strings: list[str] = field(default_factory=list)
    weights: str | None = None  # a sampler save of this session to sample with; None: the adapter as it is now
    stored: bool = False  # `weights` is a stored sampler save: loaded on demand (the agent fetches it if not here)
    object: str = ""  # a stored save of another job (a serving sampler's): the object to fetch; "": this job's own
    prompt_logprobs: bool = False  # also the log-probabilities of the prompt's tokens (Tinker's compute_logprobs)
    text: str | None = None  # the prompt as text (OpenAI's completions): the session's tokenizer encodes it
    messages: list[ChatTurn] | None = None  # the prompt as a chat (OpenAI's): the base's chat template renders it


class Ping(Struct, tag="ping", tag_field="type", kw_only=True):
    """Is the session up, and what does it train."""


class Forget(Struct, tag="forget", tag_field="type", kw_only=True):
    """A save the client deleted: its files go (a later checkpoint no longer carries it)."""

    name: Annotated[str, Meta(pattern=STORED_NAME)]
    kind: Literal["state", "sampler"]


SessionCall = ForwardBackward | OptimStep | SaveWeights | LoadWeights | Sample | Ping | Forget


def stored_sampler(out_dir: str, name: str) -> str:
    """Where a session's trainer writes its stored sampler save `name` (PEFT's layout), outside the checkpoint it
    carries, and where the agent puts one it fetched back."""
    return f"{out_dir}/{STORED_SAMPLERS}/{name}"


class SessionRequest(Struct, kw_only=True):
    """A call for the session `job` (of `tenant`, as the gateway bound it to the caller's key)."""

    job: str
    tenant: str | None
    call: SessionCall
    call_id: str = ""  # the same for every try of one call: a try that arrives twice is answered, not run, twice
    attempt: int = 0  # the job's attempt the gateway's calls went to (0: any): another attempt answers retry, so the
    # gateway looks where the session is and tells its client when a node went away, even one back under its name


# A number that is not finite (a diverged loss, log 0) travels as null (JSON has no NaN): the gateway sends NaN.
class ForwardResult(Struct, tag="forward_backward", tag_field="type", kw_only=True):
    logprobs: list[list[float | None]]  # per datum, the target tokens' log-probabilities
    loss: float | None  # the loss's sum over the batch
    tokens: int  # tokens with a nonzero weight


class StepResult(Struct, tag="optim_step", tag_field="type", kw_only=True):
    step: int  # optimizer steps taken so far
    grad_norm: float | None
    learning_rate: float


class SavedResult(Struct, tag="save", tag_field="type", kw_only=True):
    name: str
    kind: str
    step: int
    object: str = ""  # a stored sampler save: its artifact (names.sampler_save_object), set by the agent
    sha256: str = ""
    size: int = 0


class LoadedResult(Struct, tag="load", tag_field="type", kw_only=True):
    name: str
    step: int


class SampledSequence(Struct, kw_only=True):
    tokens: list[int]
    logprobs: list[float | None]
    stop: Literal["stop", "length"]
    text: str | None = None  # a sample asked in text: the sequence decoded (a stop string left out)


class SampleResult(Struct, tag="sample", tag_field="type", kw_only=True):
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # of the prompt's tokens after the first, when asked
    prompt_tokens: int = 0  # a sample asked in text: how many tokens its prompt became


class PingResult(Struct, tag="ping", tag_field="type", kw_only=True):
    step: int
    rank: int
    base_model: str  # the job's catalog name
    tokenizer_dir: str  # the base model's directory on the node (the client loads its tokenizer from there)
    arch: str = ""


class ForgotResult(Struct, tag="forget", tag_field="type", kw_only=True):
    name: str
    kind: str


class CallError(Struct, tag="error", tag_field="type", kw_only=True):
    """The call was refused (nothing changed) or failed; `field` names what to change."""

    message: str
    field: str = ""
    retry: bool = False  # the session is moving or starting: ask again


SessionReply = (
    ForwardResult | StepResult | SavedResult | LoadedResult | SampleResult | PingResult | ForgotResult | CallError
)


class SessionAnswer(Struct, tag="answer", tag_field="type", kw_only=True):
    """What the trainer prints for the call it read as line `id`."""

    id: int
    reply: SessionReply


class SessionLine(Struct, kw_only=True):
    """What the agent writes on the trainer's stdin: call number `id`, under the gateway's `call_id`."""

    id: int
    call: SessionCall
    call_id: str = ""


class MemberCall(Struct, tag="call", tag_field="type", kw_only=True):
    """Call number `id` for the session `job`'s attempt `attempt`, written on a session group's stdin."""

    job: str
    attempt: int
    id: int
    call: SessionCall
    call_id: str = ""


class MemberAnswer(Struct, tag="member_answer", tag_field="type", kw_only=True):
    """A session group's answer to MemberCall `id` of the session `job`'s attempt `attempt`, on its stdout."""

    job: str
    attempt: int
    id: int
    reply: SessionReply


class AppliedCall(Struct, kw_only=True):
    """A call that changed a session (trainer/session/applied_calls.py), kept with its checkpoint: a try of it sent again
    under its call id, after a pause or on another attempt, is answered `reply` and never runs twice (None: it ran,
    but its answer was too large to keep)."""

    id: str
    reply: SessionReply | None = None


# How those lines start (msgspec writes a tagged Struct's tag first): told apart from GroupControl and GroupEvent
# lines, which are not tagged, without decoding them twice.
CALL_LINE = b'{"type":"call"'
ANSWER_LINE = b'{"type":"member_answer"'
