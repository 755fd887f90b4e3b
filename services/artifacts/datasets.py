"""The datasets bucket: uploads checked row by row before they are stored, and the list/show/delete requests."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from schemas import names
from schemas.dataset_check import DatasetChecker, DatasetInvalid
from schemas.datasets import (DatasetChunk, DatasetChunkAck, DatasetDeleted, DatasetInfo, DatasetLimits, DatasetList,
                              DatasetListQuery, DatasetQuery, DatasetReply, DatasetUpload)
from schemas.jobs import Error
from services import bus
from services.artifacts.objinfo import dataset_from_object, dataset_headers
from services.artifacts.objwriter import ObjectWriter
from services.artifacts.receiver import ChunkReceiver, Refused
from services.streamview import object_view

log = logging.getLogger(__name__)


async def find_dataset(js, name: str) -> DatasetInfo | None:
    """The dataset stored under `name`, or None (what the scheduler asks at submit, and the agent before a fetch)."""
    obs = await js.object_store(names.DATASETS_BUCKET)
    try:
        return dataset_from_object(await obs.get_info(name))
    except NotFoundError:
        return None


@dataclass
class DatasetSink:
    """One dataset on its way into the bucket: every row is checked as it passes, the stats kept for its entry."""

    writer: ObjectWriter
    checker: DatasetChecker
    what: str
    tenants: list[str]

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
        self.writer.info.headers.update(dataset_headers(sha256, stats, self.tenants))
        return dataset_from_object(await self.writer.commit(digest))


class DatasetStore:
    def __init__(self, nc: Client, limits: DatasetLimits, stall_timeout: float = 30.0) -> None:
        self.nc, self.js, self.limits = nc, nc.jetstream(), limits
        self.receiver = ChunkReceiver(DatasetChunk, DatasetChunkAck, lambda c: c.name, self._open_sink, stall_timeout)
        self.objects = object_view(self.js, names.DATASETS_BUCKET)  # followed while the artifact service runs

    async def add_endpoints(self, service) -> None:
        group = service.add_group(name=names.DATASETS_GROUP)
        for verb, query, serve in (("list", DatasetListQuery, self._list), ("show", DatasetQuery, self._show),
                                   ("delete", DatasetQuery, self._delete)):
            await group.add_endpoint(name=f"datasets-{verb}", subject=verb, handler=bus.handler(serve, query))

    async def _open_sink(self, chunk: DatasetChunk, _subject: str) -> DatasetSink:
        upload = chunk.meta or DatasetUpload()
        if not upload.replace and (old := await find_dataset(self.js, chunk.name)) is not None:
            raise Refused(f"a dataset named {chunk.name} exists ({old.stats.rows:,} {old.stats.format} rows, sha256 "
                          f"{old.sha256[:12]}…); choose another --name, or pass --replace (jobs that pinned the old "
                          "one will then fail)")
        writer = ObjectWriter(self.js, names.DATASETS_BUCKET, chunk.name, upload.description)
        return DatasetSink(writer, DatasetChecker(upload.format, self.limits), f"dataset {chunk.name}", upload.share)

    async def _list(self, q: DatasetListQuery) -> DatasetList:
        found = [d for d in map(dataset_from_object, (await self.objects.snapshot()).values()) if d]
        return DatasetList([d for d in found if q.format is None or d.stats.format == q.format])

    async def _show(self, q: DatasetQuery) -> DatasetReply | Error:
        found = await find_dataset(self.js, q.name)
        if found is None:
            return Error(f"no dataset named {q.name}; `jetlora datasets ls` lists them", field="name")
        return DatasetReply(found)

    async def _delete(self, q: DatasetQuery) -> DatasetDeleted | Error:
        if await find_dataset(self.js, q.name) is None:
            return Error(f"no dataset named {q.name}; `jetlora datasets ls` lists them", field="name")
        obs = await self.js.object_store(names.DATASETS_BUCKET)
        await obs.delete(q.name)
        log.info("dataset %s deleted", q.name)
        return DatasetDeleted(q.name)
