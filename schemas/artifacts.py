"""Artifacts in transit (chunks) and at rest (object-store entries)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from schemas.jobs import JobId
from schemas.validate import pattern

ArtifactKind = Literal["peft", "gguf", "checkpoint", "tensorboard", "eval", "sampler"]  # eval: an eval run's results
# (JSONL); sampler: a Tinker session's named sampler save (PEFT's files, tar.gz), <job>/sampler-<save>
KEEP_CHECKPOINTS = 3  # a job's newest checkpoints kept in the store; older ones are deleted as new ones arrive
FILE_NAME = pattern(
    r"^(?!\.\.?\Z)[^/\\\x00-\x1f\x7f]*\Z",
    "must be a plain file name: no '/', '\\', control characters, and not '.' or '..'",
)
CHUNK_BYTES = 512 * 1024  # data per chunk message: well under NATS's 1 MiB default max_payload


class ArtifactMeta(Struct, kw_only=True):
    """What is recorded about an artifact besides its bytes."""

    base_model: str = ""
    trainer_version: str = ""
    summary: str = ""  # hyperparameters, in a line
    filename: Annotated[str, Meta(max_length=255, pattern=FILE_NAME)] = ""  # suggested file name when downloaded
    tenant: str = ""  # whose job made it ("": an admin's); the service writes the job's own, whatever is sent
    step: Annotated[int, Meta(ge=0)] | None = (
        None  # a checkpoint's step: each is its own object, <job>/checkpoint-<step>
    )
    attempt: Annotated[int, Meta(ge=0)] = 0  # the attempt of the job that made it: only the current one is stored
    save: Annotated[str, Meta(max_length=128, pattern=r"^[A-Za-z0-9._-]*$")] = ""  # a sampler save's name


class Chunk(Struct, kw_only=True):
    """One piece of an artifact upload (msgpack on the wire). The last one carries the sha256 of the whole."""

    upload: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # one attempt; a retry is a new upload
    job: JobId
    kind: ArtifactKind
    seq: Annotated[int, Meta(ge=0)]
    data: bytes
    last: bool = False
    sha256: str = ""  # hex, on the last chunk
    size: int = 0  # total bytes, on the last chunk
    meta: ArtifactMeta | None = None  # on the first chunk


class ChunkAck(Struct, kw_only=True):
    upload: str
    seq: int
    ok: bool
    error: str = ""
    stored: "ArtifactInfo | None" = None  # on the last chunk's ack
    retry: bool = False  # the upload failed on the service's side (it restarted, lost a chunk, its store erred):
    # sent again from chunk 0 it may pass; without it, a failure is a refusal that the same upload meets again


class ArtifactInfo(Struct, kw_only=True):
    """An artifact in the object store."""

    name: str
    job: JobId
    kind: str
    size: int
    sha256: str
    created: str
    base_model: str = ""
    trainer_version: str = ""
    summary: str = ""
    filename: str = ""
    tenant: str = ""
    step: int | None = None


class ArtifactQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    job: JobId | None = None
    kind: ArtifactKind | None = None
    name: str | None = None  # one artifact by its name (a sampler save the client deleted)


class ArtifactList(Struct, tag="artifacts", tag_field="type"):
    artifacts: list[ArtifactInfo]


class Deleted(Struct, tag="deleted", tag_field="type"):
    names: list[str]
