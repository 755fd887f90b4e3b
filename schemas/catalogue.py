"""Every message on the bus by its name: the catalogue that `jetlora schema` renders (schemas/export.py) as JSON
Schemas, and that schemas/channels.py names for each subject a message travels on."""

from __future__ import annotations

from schemas.artifacts import ArtifactList, ArtifactQuery, Chunk, ChunkAck, Deleted
from schemas.datasets import (
    DatasetChunk,
    DatasetChunkAck,
    DatasetDeleted,
    DatasetList,
    DatasetListQuery,
    DatasetQuery,
    DatasetReply,
    Pinning,
    PinningQuery,
)
from schemas.engine_evals import EngineEvalReply, EngineEvalRequest
from schemas.sessions import SessionReply, SessionRequest
from schemas.tenants import TenantList, TenantsQuery
from schemas.events import (
    CheckpointList,
    EventPage,
    EventsQuery,
    GroupControl,
    GroupEvent,
    JobEvent,
    Preparing,
    Progress,
    Samples,
    StateChange,
    TrainerEvent,
    TrainerSpec,
)
from schemas.jobs import Error, JobRequest, SubmitReply
from schemas.job_status import JobList, JobListQuery, JobQuery, JobReply, JobStatus, StoredRequest
from schemas.nodes import Assignment, AssignReply, Control, ControlReply, Heartbeat, NodeList, Reclaim, ReclaimReply
from schemas.registry import (
    AdapterList,
    AdapterListQuery,
    AdapterQuery,
    AdapterReply,
    AliasRequest,
    NodeAdapterStatus,
    PromoteRequest,
    References,
    ReferencesQuery,
    RegisterRequest,
)


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
    "GroupControl": GroupControl,
    "GroupEvent": GroupEvent,
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
    "ReferencesQuery": ReferencesQuery,
    "References": References | Error,
    "PinningQuery": PinningQuery,
    "Pinning": Pinning | Error,
    "EngineEvalRequest": EngineEvalRequest,
    "EngineEvalReply": EngineEvalReply | Error,
    "SessionRequest": SessionRequest,
    "SessionReply": SessionReply,
    "TenantsQuery": TenantsQuery,
    "TenantList": TenantList | Error,
}
