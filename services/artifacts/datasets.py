"""The datasets bucket: uploads checked row by row before they are stored, and the list/show/delete requests."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from nats.aio.client import Client

from schemas import names, subject_parts
from schemas.dataset_check import DatasetChecker, DatasetInvalid
from schemas.datasets import (
    DatasetChunk,
    DatasetChunkAck,
    DatasetDeleted,
    DatasetInfo,
    DatasetLimits,
    DatasetList,
    DatasetListQuery,
    DatasetQuery,
    DatasetReply,
    DatasetUpload,
    Pinning,
    PinningQuery,
    check_new_name,
)
from schemas.jobs import Error
from schemas.object_headers import dataset_from_object, dataset_headers, visible_to
from services import bus
from services.jetstream_writer import JetStreamWriter
from services.artifacts.objwriter import ObjectChanged, ObjectWriter
from services.artifacts.receiver import ChunkReceiver, Refused
from services.store_views import object_view
from services.transfer.datasets import find_dataset, visible_dataset

log = logging.getLogger(__name__)
PINNING_TIMEOUT_S = 10.0  # how long a delete waits for the scheduler to say which unfinished jobs name the dataset


def _taken(name: str, old: DatasetInfo | None) -> str:
    """Why an upload without --replace is refused: the name holds a dataset."""
    what = f" ({old.stats.rows:,} {old.stats.format} rows, sha256 {old.sha256[:12]}…)" if old is not None else ""
    return (
        f"a dataset named {name} exists{what}; choose another --name, or pass --replace (jobs that pinned the old "
        "one will then fail)"
    )


@dataclass
class DatasetSink:
    """One dataset on its way into the bucket: every row is checked as it passes, the stats kept for its entry."""

    writer: ObjectWriter
    checker: DatasetChecker
    what: str
    tenants: list[str]
    owner: str | None
    name: str  # as the uploader gave it (the object's name has the owner's prefix)

    def check(self, data: bytes) -> None:
        try:
            self.checker.feed(data)
        except DatasetInvalid as e:
            raise Refused(str(e)) from None

    async def commit(self, sha256: str, digest: bytes) -> DatasetInfo:
        try:
            stats = self.checker.finish()
        except DatasetInvalid as e:
            raise Refused(str(e)) from None
        self.writer.headers.update(dataset_headers(sha256, stats, self.tenants, self.owner))
        try:
            stored = dataset_from_object(await self.writer.commit(digest))
        except ObjectChanged:  # another upload of the name committed after this one began: it keeps the name
            theirs = await find_dataset(self.writer.js, self.writer.name)
            raise Refused(_taken(self.name, theirs) + " (it was stored while this upload was under way)") from None
        assert stored is not None  # it carries jetlora's dataset headers
        return stored


class DatasetStore:
    def __init__(
        self, nc: Client, limits: DatasetLimits, stall_timeout: float = 30.0, writer: JetStreamWriter | None = None
    ) -> None:
        self.nc, self.js, self.limits = nc, nc.jetstream(), limits
        self.writer = writer or JetStreamWriter(nc)
        self.receiver = ChunkReceiver(DatasetChunk, DatasetChunkAck, lambda c: c.name, self._open_sink, stall_timeout)
        self.objects = object_view(self.js, names.DATASETS_BUCKET)  # followed while the artifact service runs

    async def add_endpoints(self, service) -> None:
        group = service.add_group(name=names.DATASETS_GROUP)
        for verb, query, serve in (
            ("list", DatasetListQuery, self._list),
            ("show", DatasetQuery, self._show),
            ("delete", DatasetQuery, self._delete),
        ):  # an admin's, and each tenant's
            answer = bus.handler(
                lambda q, subject, serve=serve: serve(q, bus.tenant_of(subject)), query, with_subject=True
            )
            await bus.add_endpoint(group, f"datasets-{verb}", answer, verb)
            await bus.add_endpoint(group, f"datasets-tenant-{verb}", answer, f"*.{verb}")

    async def _pinned_by(self, name: str, stored: str) -> Pinning | Error:
        """Which unfinished jobs name this stored dataset: the scheduler holds every one in memory and is asked (a
        page of them, and their count). One that does not answer deletes nothing but a forced delete."""
        try:
            return await bus.request(
                self.nc, names.DATASET_PINNING, PinningQuery(dataset=stored), Pinning | Error, PINNING_TIMEOUT_S
            )
        except bus.RequestError as e:
            return Error(
                f"dataset {name} was not deleted: the scheduler did not say which unfinished jobs name it ({e}); "
                "try again once it answers, or delete it anyway with --force",
                field="force",
            )

    async def _open_sink(self, chunk: DatasetChunk, subject: str) -> DatasetSink:
        """A tenant's upload (its subject says whose) is stored under the tenant's prefix and shared with nobody."""
        upload = chunk.meta or DatasetUpload()
        try:
            owner = subject_parts.tenant_of_dataset_upload(subject)
            check_new_name(chunk.name)
        except ValueError as e:
            raise Refused(str(e)) from None
        if owner is not None and upload.share:
            raise Refused("a tenant's dataset is its own: only an admin's upload may --share it")
        stored = names.dataset_object(chunk.name, owner)
        writer = ObjectWriter(self.js, self.writer, names.DATASETS_BUCKET, stored, upload.description)
        if not upload.replace:  # the name must still be free when the upload commits: see DatasetSink.commit
            old, writer.expect_sequence = await writer.current()
            if (found := dataset_from_object(old) if old is not None else None) is not None:
                raise Refused(_taken(chunk.name, found))
        first_bad_row = msgspec.structs.replace(self.limits, max_errors=1)  # stop the transfer there: `datasets put`
        return DatasetSink(
            writer, DatasetChecker(upload.format, first_bad_row), f"dataset {stored}", upload.share, owner, chunk.name
        )  # lists the file's other bad rows itself

    async def _list(self, q: DatasetListQuery, tenant: str | None) -> DatasetList:
        found = [d for d in map(dataset_from_object, (await self.objects.snapshot()).values()) if d]
        if tenant is not None:  # its own, and the admins' shared with it
            found = [d for d in found if visible_to(d, tenant)]
        return DatasetList([d for d in found if q.format is None or d.stats.format == q.format])

    async def _show(self, q: DatasetQuery, tenant: str | None) -> DatasetReply | Error:
        found = await visible_dataset(self.js, q.name, tenant)
        if found is None:
            return Error(f"no dataset named {q.name}; `jetlora datasets ls` lists them", field="name")
        return DatasetReply(found)

    async def _delete(self, q: DatasetQuery, tenant: str | None) -> DatasetDeleted | Error:
        """A tenant deletes only its own; an admin the admins' (a shared one stays until an admin deletes it)."""
        stored = names.dataset_object(q.name, tenant)
        if await find_dataset(self.js, stored) is None:
            return Error(f"no dataset named {q.name} of yours; `jetlora datasets ls` lists them", field="name")
        pinned = None if q.force else await self._pinned_by(q.name, stored)
        if isinstance(pinned, Error):
            return pinned
        if pinned is not None and pinned.count:
            more = " ..." if pinned.count > len(pinned.jobs) else ""
            shown = ", ".join(f"{p.job} ({p.state})" for p in pinned.jobs) + more
            return Error(
                f"dataset {q.name} is named by {pinned.count} unfinished job(s): {shown}; a node that has not "
                "fetched it yet would fail them. Cancel them (or let them finish) first, or delete it anyway "
                "with --force",
                field="name",
            )
        obs = await self.js.object_store(names.DATASETS_BUCKET)
        await obs.delete(stored)
        log.info("dataset %s deleted", stored)
        return DatasetDeleted(q.name)
