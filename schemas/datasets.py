"""Training data stored once and named by jobs: the row formats, the upload's chunks, and the dataset API.

A dataset is a JSON-lines file: one example per line, in one of the formats below. Every row is checked
before anything is stored (`schemas.dataset_check`), so a stored dataset is known to be well formed.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from schemas import names
from schemas.jobs import DatasetName, DatasetRef, JobId, TenantId  # noqa: F401 (a job names its data with a DatasetRef)
from schemas.job_status import JobState  # noqa: F401 (a job names its data with a DatasetRef)

DatasetFormat = Literal["qa", "chat", "alpaca", "text", "preference", "rft", "evals"]
FORMATS: dict[str, str] = {  # what each format's rows hold, as error messages show it
    "qa": '{"q": question, "a": answer}',
    "chat": '{"messages": [{"role": "system"|"user"|"assistant", "content": text, "weight": 0|1 (optional)}, ...]}',
    "alpaca": '{"instruction": text, "input": text (optional), "output": text}',
    "text": '{"text": text} (continued pre-training: the loss covers every token)',
    "preference": '{"input": {"messages": [...]}, "preferred_output": [{"role": "assistant", "content": text}], '
    '"non_preferred_output": [{"role": "assistant", "content": text}]} (OpenAI\'s, for DPO)',
    "rft": '{"messages": [..., {"role": "user", "content": text}], ...any fields the grader reads as {{item.<field>}}} '
    "(OpenAI's reinforcement fine-tuning rows, for GRPO: the messages end with the user turn the model answers)",
    "evals": '{"item": {...}, "sample": {...}}, or any JSON object (OpenAI\'s eval data, files of purpose "evals": '
    "checked only as JSON objects, read by eval runs, never trained on; never detected, only named)",
}
ROLES = ("system", "user", "assistant")


# --- rows, one per line, as each format defines them -----------------------------------------------
# gc=False: rows hold only strings and numbers, never a cycle, and millions are decoded at once (a fifth faster)
class QARow(Struct, gc=False):
    q: str
    a: str


class ChatMessage(Struct, gc=False):
    role: str
    content: str
    weight: int | None = None  # OpenAI's: 0 keeps an assistant turn as context, without learning it
    name: str | None = None


class ChatRow(Struct, gc=False):
    messages: list[ChatMessage]


class AlpacaRow(Struct, gc=False):
    instruction: str
    output: str
    input: str = ""


class TextRow(Struct, gc=False):
    text: str


class PreferenceInput(Struct, gc=False):
    messages: list[ChatMessage]


class PreferenceRow(Struct, gc=False):
    """OpenAI's preference row: a conversation, then the answer preferred to it and the one not (DPO)."""

    input: PreferenceInput
    preferred_output: list[ChatMessage]
    non_preferred_output: list[ChatMessage]


class RftRow(Struct, gc=False):
    """OpenAI's reinforcement fine-tuning row: a conversation up to the turn the model answers; the row's other
    fields (any) are the grader's `item`."""

    messages: list[ChatMessage]


ROW_TYPES: dict[str, type] = {
    "qa": QARow,
    "chat": ChatRow,
    "alpaca": AlpacaRow,
    "text": TextRow,
    "preference": PreferenceRow,
    "rft": RftRow,
    "evals": dict,  # any JSON object: an eval's item and sample, checked against the eval's item_schema by each run
}


# --- what is known about a stored dataset ----------------------------------------------------------
class DatasetLimits(Struct, kw_only=True):
    """What an upload may be; each limit is named in the error that refuses a file over it."""

    max_bytes: int = 8 * 2**30
    max_rows: int = 20_000_000
    max_row_bytes: int = 2 * 2**20
    max_errors: int = 10  # bad rows reported before the upload is refused


class DatasetStats(Struct, kw_only=True):
    """Token-free figures of a dataset, from the upload's check."""

    format: DatasetFormat
    rows: int
    chars_mean: float  # characters of text per row
    chars_max: int
    roles: dict[str, int] = field(default_factory=dict)  # chat: messages per role
    turns_trained: int = 0  # chat: assistant messages the loss covers (weight not 0)
    head: list[str] = field(default_factory=list)  # the first rows, as uploaded (each cut to HEAD_CHARS)


HEAD_ROWS, HEAD_CHARS = 3, 600


class DatasetInfo(Struct, kw_only=True):
    """A dataset in the object store."""

    name: DatasetName
    sha256: str
    size: int
    created: str
    stats: DatasetStats
    description: str = ""
    tenants: list[TenantId] = field(default_factory=list)  # the tenants an admin shared it with (their jobs may use it)
    owner: TenantId | None = None  # the tenant that uploaded it; None: an admin


# --- the upload: chunk messages, as artifacts travel ----------------------------------------------
VERBS = frozenset(names.DatasetsApi._fields)  # a dataset of one of these names would upload on a request's subject


def check_new_name(name: str) -> str:
    """A new dataset's name (the service, `jetlora datasets put` and the gateway's uploads all check it): one
    subject token, and none of the datasets API's verbs (an admin's upload of `list`, jetlora.datasets.upload.list,
    would also be the request jetlora.datasets.<tenant>.list). ValueError names the field and the fix."""
    names.check_token(name, "dataset name")
    if name in VERBS:
        raise ValueError(
            f"dataset name {name!r} is one of the datasets API's verbs ({', '.join(sorted(VERBS))}): its upload "
            "would travel on that request's subject; choose another name"
        )
    return name


class DatasetUpload(Struct, forbid_unknown_fields=True, kw_only=True):
    """What the first chunk says about the file."""

    format: DatasetFormat | Literal["auto"] = "auto"
    replace: bool = False  # a dataset of that name is replaced (jobs that pinned the old one then fail)
    description: Annotated[str, Meta(max_length=1000)] = ""
    share: list[TenantId] = field(default_factory=list)  # tenants whose jobs may train on it; none: admins' only


class DatasetChunk(Struct, kw_only=True):
    """One piece of a dataset upload (msgpack on the wire). The last one carries the sha256 of the whole."""

    upload: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    name: DatasetName
    seq: Annotated[int, Meta(ge=0)]
    data: bytes
    last: bool = False
    sha256: str = ""
    size: int = 0
    meta: DatasetUpload | None = None  # on the first chunk


class DatasetChunkAck(Struct, kw_only=True):
    upload: str
    seq: int
    ok: bool
    error: str = ""
    stored: DatasetInfo | None = None  # on the last chunk's ack
    retry: bool = False  # as ChunkAck's: the service failed the upload for a reason of its own, not the file's


# --- requests ------------------------------------------------------------------------------------
class DatasetQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    name: DatasetName
    force: bool = False  # delete: even while unfinished jobs pin it (they then fail on a node that has not fetched it)


class DatasetListQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    format: DatasetFormat | None = None


class DatasetReply(Struct, tag="dataset", tag_field="type"):
    dataset: DatasetInfo


class DatasetList(Struct, tag="datasets", tag_field="type"):
    datasets: list[DatasetInfo]


class DatasetDeleted(Struct, tag="deleted", tag_field="type"):
    name: str


# --- which unfinished jobs name a dataset: the artifact service asks the scheduler before a delete ---------------
class PinningQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    """On names.DATASET_PINNING: the unfinished jobs (queued, running, paused...) whose dataset or
    validation_dataset is the dataset stored under `dataset`, answered from the scheduler's memory."""

    dataset: Annotated[str, Meta(min_length=1, description="its object name: `<tenant>/<name>` for a tenant's")]
    limit: Annotated[int, Meta(ge=0, le=1000)] = 5  # how many of them to name (all are counted)


class PinnedJob(Struct, kw_only=True):
    """One unfinished job that names the dataset, and its state."""

    job: JobId
    state: JobState


class Pinning(Struct, tag="pinning", tag_field="type", kw_only=True):
    """The scheduler's answer to a PinningQuery."""

    count: int  # every unfinished job that names the dataset
    jobs: list[PinnedJob]  # the first `limit` of them, by id
