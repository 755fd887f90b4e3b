"""The artifact service: assembles chunked uploads into the object store (artifacts and datasets), lists and deletes them."""

from __future__ import annotations

import asyncio
from typing import Any
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats.micro
from nats.aio.client import Client

from schemas import names, subject_parts
from schemas.artifacts import (
    KEEP_CHECKPOINTS,
    ArtifactInfo,
    ArtifactList,
    ArtifactMeta,
    ArtifactQuery,
    Chunk,
    ChunkAck,
    Deleted,
)
from schemas.datasets import DatasetLimits
from schemas.jobs import Error
from schemas.object_headers import artifact_headers, info_from_object, sha256_header
from services import __version__, bus
from services.aio import cancel_and_wait
from services.artifacts.datasets import DatasetStore
from services.jetstream_writer import JetStreamWriter
from services.job_records import JobRecords
from services.artifacts.objwriter import ObjectWriter
from services.artifacts.receiver import ChunkReceiver, Refused
from services.store_views import object_view

log = logging.getLogger(__name__)


@dataclass
class ArtifactSink:
    """One artifact on its way into the artifacts bucket."""

    writer: ObjectWriter
    what: str
    after_commit: Callable[[ArtifactInfo], Awaitable[None]] | None = None
    before_commit: Callable[[], Awaitable[None]] | None = None  # raises Refused when the upload is no longer wanted

    def check(self, data: bytes) -> None:
        pass  # an artifact is whatever the trainer made; its sha256 is what is checked

    async def commit(self, sha256: str, digest: bytes) -> ArtifactInfo:
        if self.before_commit:
            await self.before_commit()
        key, value = sha256_header(sha256)
        self.writer.headers[key] = value
        stored = info_from_object(await self.writer.commit(digest))
        assert stored is not None  # it carries jetlora's headers: it is an artifact
        if self.after_commit:
            try:
                await self.after_commit(stored)
            except Exception as e:  # the artifact is stored; tidying up can wait for the next one
                log.warning("after storing %s: %s", stored.name, e)
        return stored


class ArtifactService:
    """Serves the artifacts bucket (uploads, list, delete) and the datasets bucket (DatasetStore)."""

    def __init__(self, nc: Client, stall_timeout: float = 30.0, dataset_limits: DatasetLimits | None = None) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.writer = JetStreamWriter(nc)  # object chunks, each ack with a time limit
        self.receiver = ChunkReceiver(Chunk, ChunkAck, lambda c: c.job, self._open_sink, stall_timeout)
        self.datasets = DatasetStore(nc, dataset_limits or DatasetLimits(), stall_timeout, self.writer)
        self.objects = object_view(self.js, names.ARTIFACTS_BUCKET)
        self.ready = asyncio.Event()

    @property
    def uploads(self) -> dict:
        return self.receiver.uploads

    async def run(self, stop: asyncio.Event) -> None:
        self.obs = await self.js.object_store(names.ARTIFACTS_BUCKET)
        self.jobs = await JobRecords.open(self.js)  # the scheduler's records, read through their stored format
        views = [asyncio.create_task(v.run(stop)) for v in (self.objects, self.datasets.objects)]
        limits: dict[str, Any] = dict(pending_msgs_limit=4096, pending_bytes_limit=256 * 1024 * 1024)
        subs = [
            await self.nc.subscribe(
                names.ARTIFACTS_UPLOAD_ALL, queue="jetlora-artifacts", cb=self.receiver.on_chunk, **limits
            ),
            await self.nc.subscribe(
                names.DATASETS_UPLOAD_ALL, queue="jetlora-datasets", cb=self.datasets.receiver.on_chunk, **limits
            ),
            await self.nc.subscribe(
                names.TENANT_DATASETS_UPLOAD_ALL, queue="jetlora-datasets", cb=self.datasets.receiver.on_chunk, **limits
            ),
        ]
        service = await nats.micro.add_service(
            self.nc, name=names.ARTIFACT_SERVICE, version=__version__, description="jetlora artifact and dataset store"
        )
        group = service.add_group(name=names.ARTIFACTS_GROUP)
        for verb, serve in (("list", self._list), ("delete", self._delete)):  # an admin's, and each tenant's
            answer = bus.handler(
                lambda q, subject, serve=serve: serve(q, bus.tenant_of(subject)), ArtifactQuery, with_subject=True
            )
            await bus.add_endpoint(group, verb, answer)
            await bus.add_endpoint(group, f"tenant-{verb}", answer, f"*.{verb}")
        await self.datasets.add_endpoints(service)
        reapers = [asyncio.create_task(r.reap_stalled(stop)) for r in (self.receiver, self.datasets.receiver)]
        await self.nc.flush()
        self.ready.set()
        log.info("artifact service up, buckets %s and %s", names.ARTIFACTS_BUCKET, names.DATASETS_BUCKET)
        try:
            await stop.wait()
        finally:
            await cancel_and_wait(reapers + views)
            await service.stop()
            for sub in subs:
                await sub.unsubscribe()
            for receiver in (self.receiver, self.datasets.receiver):
                await receiver.close()  # purges finish before the service ends
            await self.writer.close()

    async def _open_sink(self, chunk: Chunk, subject: str) -> ArtifactSink:
        meta = await self._checked_meta(chunk, subject_parts.uploader_of_subject(subject))
        if chunk.kind == "sampler":
            name = names.sampler_save_object(chunk.job, meta.save)
        else:
            name = names.artifact_name(chunk.job, chunk.kind, meta.step if chunk.kind == "checkpoint" else None)
        headers = artifact_headers(chunk.job, chunk.kind, meta)
        writer = ObjectWriter(
            self.js,
            self.writer,
            names.ARTIFACTS_BUCKET,
            name,
            f"jetlora {chunk.kind} artifact of job {chunk.job}",
            headers,
        )
        node = subject_parts.uploader_of_subject(subject)

        async def still_current() -> None:  # an attempt superseded while it uploaded must not commit over the next
            await self._checked_meta(msgspec.structs.replace(chunk, meta=meta), node)

        return ArtifactSink(
            writer, name, self._keep_newest_checkpoints if chunk.kind == "checkpoint" else None, still_current
        )

    async def _checked_meta(self, chunk: Chunk, node: str) -> ArtifactMeta:
        """The upload's description, bound to the job's record: only the node that holds the job's current
        attempt may upload for it, and the tenant is the job's, whatever the uploader says."""
        meta = chunk.meta or ArtifactMeta()
        found = await self.jobs.find(chunk.job)
        if found is None:
            raise Refused(f"no job {chunk.job}: artifacts are stored only for jobs the scheduler knows")
        stored, status = found
        if status is None or status.node != node or (meta.attempt and meta.attempt != status.attempt):
            held = f"attempt {status.attempt} on {status.node}" if status and status.node else "no attempt running"
            log.warning(
                "refused a %s upload for job %s from node %s (attempt %d): the job has %s",
                chunk.kind,
                chunk.job,
                node,
                meta.attempt,
                held,
            )
            raise Refused(
                f"job {chunk.job} has {held}, not attempt {meta.attempt} on {node}: only the node running "
                "the job's current attempt stores its artifacts"
            )
        if chunk.kind == "checkpoint" and meta.step is None:
            raise Refused("a checkpoint's first chunk must say its step (meta.step)")
        if chunk.kind == "sampler" and not meta.save:
            raise Refused("a sampler save's first chunk must say its name (meta.save)")
        return msgspec.structs.replace(meta, tenant=stored.tenant or "", attempt=status.attempt)

    async def _keep_newest_checkpoints(self, stored: ArtifactInfo) -> None:
        """A job's checkpoints beyond the newest KEEP_CHECKPOINTS are deleted once a new one is stored."""
        mine = [
            a for a in await self.list_artifacts(ArtifactQuery(job=stored.job, kind="checkpoint")) if a.step is not None
        ]
        for old in sorted(mine, key=lambda a: a.step or 0, reverse=True)[KEEP_CHECKPOINTS:]:
            await self.obs.delete(old.name)

    # --- operators' requests -------------------------------------------------------------------
    async def list_artifacts(self, q: ArtifactQuery, tenant: str | None = None) -> list[ArtifactInfo]:
        """Artifacts matching the query; a tenant's own only, when one asks."""
        out = [a for a in map(info_from_object, (await self.objects.snapshot()).values()) if a]
        return [
            a
            for a in out
            if (q.job is None or a.job == q.job)
            and (q.kind is None or a.kind == q.kind)
            and (q.name is None or a.name == q.name)
            and (tenant is None or a.tenant == tenant)
        ]

    async def _list(self, q: ArtifactQuery, tenant: str | None) -> ArtifactList:
        return ArtifactList(await self.list_artifacts(q, tenant))

    async def _delete(self, q: ArtifactQuery, tenant: str | None) -> Deleted | Error:
        if q.job is None:
            return Error("say which job's artifacts to delete", field="job")
        gone = []
        for a in await self.list_artifacts(q, tenant):
            await self.obs.delete(a.name)
            gone.append(a.name)
        return Deleted(gone)
