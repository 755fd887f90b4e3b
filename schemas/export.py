"""Write the JSON Schema of every message and an AsyncAPI 3 document of every subject: `jetlora schema`."""

from __future__ import annotations

import json
from typing import Any
from pathlib import Path

import msgspec

from schemas import names
from schemas.artifacts import ArtifactList, ArtifactQuery, Chunk, ChunkAck, Deleted
from schemas.datasets import (
    DatasetChunk,
    DatasetChunkAck,
    DatasetDeleted,
    DatasetList,
    DatasetListQuery,
    DatasetQuery,
    DatasetReply,
)
from schemas.events import (
    CheckpointList,
    EventPage,
    EventsQuery,
    JobEvent,
    Preparing,
    Progress,
    Samples,
    StateChange,
    TrainerEvent,
    TrainerSpec,
)
from schemas.jobs import (
    Error,
    JobList,
    JobListQuery,
    JobQuery,
    JobReply,
    JobRequest,
    JobStatus,
    StoredRequest,
    SubmitReply,
)
from schemas.nodes import Assignment, AssignReply, Control, ControlReply, Heartbeat, NodeList, Reclaim, ReclaimReply
from schemas.registry import (
    AdapterList,
    AdapterListQuery,
    AdapterQuery,
    AdapterReply,
    AliasRequest,
    NodeAdapterStatus,
    PromoteRequest,
    RegisterRequest,
)

HERE = Path(__file__).parent

MESSAGES = {
    "JobRequest": JobRequest,
    "SubmitReply": SubmitReply,
    "JobQuery": JobQuery,
    "JobReply": JobReply | Error,
    "JobListQuery": JobListQuery,
    "JobList": JobList | Error,
    "NodeList": NodeList,
    "Heartbeat": Heartbeat,
    "Assignment": Assignment,
    "AssignReply": AssignReply,
    "Control": Control,
    "ControlReply": ControlReply,
    "StateChange": StateChange,
    "Progress": Progress,
    "JobEvent": JobEvent,
    "Chunk": Chunk,
    "ChunkAck": ChunkAck,
    "ArtifactQuery": ArtifactQuery,
    "ArtifactList": ArtifactList | Error,
    "Deleted": Deleted | Error,
    "StoredRequest": StoredRequest,
    "JobStatus": JobStatus,
    "TrainerSpec": TrainerSpec,
    "TrainerEvent": TrainerEvent,
    "Preparing": Preparing,
    "DatasetChunk": DatasetChunk,
    "DatasetChunkAck": DatasetChunkAck,
    "DatasetListQuery": DatasetListQuery,
    "DatasetList": DatasetList | Error,
    "DatasetQuery": DatasetQuery,
    "DatasetReply": DatasetReply | Error,
    "DatasetDeleted": DatasetDeleted | Error,
    "Samples": Samples,
    "EventsQuery": EventsQuery,
    "EventPage": EventPage | Error,
    "CheckpointList": CheckpointList | Error,
    "Reclaim": Reclaim,
    "ReclaimReply": ReclaimReply,
    "RegisterRequest": RegisterRequest,
    "PromoteRequest": PromoteRequest,
    "AliasRequest": AliasRequest,
    "AdapterQuery": AdapterQuery,
    "AdapterListQuery": AdapterListQuery,
    "AdapterReply": AdapterReply | Error,
    "AdapterList": AdapterList | Error,
    "NodeAdapterStatus": NodeAdapterStatus,
}

# (address, kind, message, reply, who sends, what it is)
CHANNELS = [
    (
        names.SUBMIT,
        "request",
        "JobRequest",
        "SubmitReply",
        "submitters",
        "submit a job; the reply is accepted (id) or rejected (field errors)",
    ),
    (names.GET_JOB, "request", "JobQuery", "JobReply", "submitters", "one job's state"),
    (names.LIST_JOBS, "request", "JobListQuery", "JobList", "submitters", "jobs, filtered by state or node"),
    (names.CANCEL, "request", "JobQuery", "JobReply", "submitters", "cancel a job: its trainer is killed"),
    (
        names.STOP,
        "request",
        "JobQuery",
        "JobReply",
        "submitters",
        "stop a job: it saves its adapter and ends as stopped",
    ),
    (
        names.PAUSE,
        "request",
        "JobQuery",
        "JobReply",
        "submitters",
        "pause a job: it checkpoints and frees its device, keeping its place in the records",
    ),
    (
        names.RESUME,
        "request",
        "JobQuery",
        "JobReply",
        "submitters",
        "queue a paused job again, to go on from its checkpoint",
    ),
    (
        names.EVENTS,
        "request",
        "EventsQuery",
        "EventPage",
        "submitters",
        "a job's events a page at a time, from the JOBS stream (pass `next` as `after` for the next page)",
    ),
    (
        names.CHECKPOINTS,
        "request",
        "JobQuery",
        "CheckpointList",
        "submitters",
        "a job's stored checkpoints: step, train and eval loss, object-store name",
    ),
    (names.LIST_NODES, "request", None, "NodeList", "operators", "nodes, their devices and what runs there"),
    (
        names.jobs_api("{tenant}").submit,
        "request",
        "JobRequest",
        "SubmitReply",
        "a tenant's submitters",
        "submit a job as this tenant (its quota applies)",
    ),
    (
        names.jobs_api("{tenant}").job,
        "request",
        "JobQuery",
        "JobReply",
        "a tenant's submitters",
        "one of the tenant's jobs",
    ),
    (
        names.jobs_api("{tenant}").jobs,
        "request",
        "JobListQuery",
        "JobList",
        "a tenant's submitters",
        "the tenant's jobs",
    ),
    (
        names.jobs_api("{tenant}").cancel,
        "request",
        "JobQuery",
        "JobReply",
        "a tenant's submitters",
        "cancel one of the tenant's jobs",
    ),
    (
        names.jobs_api("{tenant}").stop,
        "request",
        "JobQuery",
        "JobReply",
        "a tenant's submitters",
        "stop one of the tenant's jobs",
    ),
    (
        names.jobs_api("{tenant}").pause,
        "request",
        "JobQuery",
        "JobReply",
        "a tenant's submitters",
        "pause one of the tenant's jobs",
    ),
    (
        names.jobs_api("{tenant}").resume,
        "request",
        "JobQuery",
        "JobReply",
        "a tenant's submitters",
        "resume one of the tenant's jobs",
    ),
    (
        names.jobs_api("{tenant}").events,
        "request",
        "EventsQuery",
        "EventPage",
        "a tenant's submitters",
        "a page of one of the tenant's jobs' events",
    ),
    (
        names.jobs_api("{tenant}").checkpoints,
        "request",
        "JobQuery",
        "CheckpointList",
        "a tenant's submitters",
        "the checkpoints of one of the tenant's jobs",
    ),
    (
        names.node("{node}").heartbeat,
        "publish",
        "Heartbeat",
        None,
        "agents",
        "an agent is alive; its devices' free memory",
    ),
    (names.node("{node}").assign, "request", "Assignment", "AssignReply", "scheduler", "run this job on that device"),
    (
        names.node("{node}").control,
        "request",
        "Control",
        "ControlReply",
        "scheduler",
        "cancel, stop or pause a running job",
    ),
    (
        names.node("{node}").reclaim,
        "request",
        "Reclaim",
        "ReclaimReply",
        "serving engines",
        "a device's serving engine wants memory back (or no longer does): the job there pauses if its priority allows",
    ),
    (
        names.job("{job}", "{node}").state,
        "publish",
        "StateChange",
        None,
        "agents",
        "the job changed state (JetStream: JOBS stream)",
    ),
    (
        names.job("{job}", "{node}").progress,
        "publish",
        "Progress",
        None,
        "agents",
        "a training step's figures (JetStream: JOBS stream; replayable)",
    ),
    (
        names.job("{job}", "{node}").preparing,
        "publish",
        "Preparing",
        None,
        "agents",
        "tokenizing the job's data, before its first step (JetStream: JOBS stream)",
    ),
    (
        names.job("{job}", "{node}").samples,
        "publish",
        "Samples",
        None,
        "agents",
        "the adapter's (or the base model's) greedy answers to the job's sample prompts (JetStream: JOBS stream)",
    ),
    (
        names.dataset_upload("{dataset}"),
        "request",
        "DatasetChunk",
        "DatasetChunkAck",
        "submitters",
        "one chunk of a dataset upload (msgpack); every row is checked before the dataset is stored",
    ),
    (names.DATASETS.list, "request", "DatasetListQuery", "DatasetList", "submitters", "datasets in the object store"),
    (
        names.DATASETS.show,
        "request",
        "DatasetQuery",
        "DatasetReply",
        "submitters",
        "one dataset: format, rows, characters per row, roles seen, the first rows",
    ),
    (names.DATASETS.delete, "request", "DatasetQuery", "DatasetDeleted", "operators", "delete a dataset"),
    (
        names.ADAPTERS.register,
        "request",
        "RegisterRequest",
        "AdapterReply",
        "operators",
        "a succeeded job's adapter as the next version of NAME (promoted if asked)",
    ),
    (
        names.ADAPTERS.list,
        "request",
        "AdapterListQuery",
        "AdapterList",
        "operators",
        "adapters: their versions, what each serves and what every node's engines loaded",
    ),
    (names.ADAPTERS.show, "request", "AdapterQuery", "AdapterReply", "operators", "one adapter"),
    (
        names.ADAPTERS.promote,
        "request",
        "PromoteRequest",
        "AdapterReply",
        "operators",
        "NAME@N becomes what NAME serves (compare-and-set on `expect`); agents load it into their engines",
    ),
    (names.ADAPTERS.rollback, "request", "AliasRequest", "AdapterReply", "operators", "NAME serves its version before"),
    (
        names.ADAPTERS.retire,
        "request",
        "AliasRequest",
        "AdapterReply",
        "operators",
        "NAME serves nothing; engines unload it",
    ),
    (
        names.adapter_status("{node}"),
        "publish",
        "NodeAdapterStatus",
        None,
        "agents",
        "what a node's engine did with an adapter: loading, loaded (with a smoke completion), needs-restart, failed",
    ),
    (
        names.artifact_upload("{node}", "{job}"),
        "request",
        "Chunk",
        "ChunkAck",
        "agents",
        "one chunk of an artifact (msgpack)",
    ),
    (names.ARTIFACTS_LIST, "request", "ArtifactQuery", "ArtifactList", "operators", "artifacts in the object store"),
    (names.ARTIFACTS_DELETE, "request", "ArtifactQuery", "Deleted", "operators", "delete a job's artifacts"),
    (
        names.artifacts_api("{tenant}").list,
        "request",
        "ArtifactQuery",
        "ArtifactList",
        "a tenant's submitters",
        "the artifacts of the tenant's jobs",
    ),
    (
        names.artifacts_api("{tenant}").delete,
        "request",
        "ArtifactQuery",
        "Deleted",
        "a tenant's submitters",
        "delete artifacts of one of the tenant's jobs",
    ),
]


def json_schemas() -> dict:
    out = {}
    for name, t in MESSAGES.items():
        out[name] = msgspec.json.schema(t)
    return out


def asyncapi() -> dict:
    channels, operations = {}, {}
    for address, kind, message, reply, who, what in CHANNELS:
        cid = address.replace(".", "_").replace("{", "").replace("}", "")
        params = {
            p: {"description": f"the {p} id"} for p in ("node", "job", "tenant", "dataset") if "{" + p + "}" in address
        }
        ch = {"address": address, "description": what, "messages": {}}
        if params:
            ch["parameters"] = params
        if message:
            ch["messages"][message] = {"$ref": f"#/components/messages/{message}"}
        channels[cid] = ch
        op: dict[str, Any] = {"action": "send", "channel": {"$ref": f"#/channels/{cid}"}, "summary": f"{who}: {what}"}
        if message:
            op["messages"] = [{"$ref": f"#/channels/{cid}/messages/{message}"}]
        if reply:
            rid = cid + "_reply"
            channels[rid] = {
                "address": None,
                "description": f"the reply inbox of {address}",
                "messages": {reply: {"$ref": f"#/components/messages/{reply}"}},
            }
            op["reply"] = {"channel": {"$ref": f"#/channels/{rid}"}}
        operations[cid] = op
    messages = {
        n: {
            "name": n,
            "contentType": "application/msgpack" if n == "Chunk" else "application/json",
            "payload": {"$ref": f"json/{n}.json"},
        }
        for n in MESSAGES
    }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "jetlora",
            "version": "0.1.0",
            "description": "Distributed LoRA fine-tuning over NATS. JetStream: stream "
            f"{names.JOBS_STREAM} ({names.JOBS_STREAM_SUBJECTS[0]}), KV {names.JOBS_KV}, "
            f"object store {names.ARTIFACTS_BUCKET}.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages},
    }


def rendered() -> dict[str, str]:
    """File name (relative to schemas/) -> content."""
    files = {f"json/{n}.json": json.dumps(s, indent=2, sort_keys=True) + "\n" for n, s in json_schemas().items()}
    files["asyncapi.json"] = json.dumps(asyncapi(), indent=2) + "\n"
    return files


def write_all(out: Path | None = None) -> list[Path]:
    out = out or HERE
    paths = []
    for rel, text in rendered().items():
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        paths.append(p)
    return paths
