"""/v1/files: a tenant's datasets as OpenAI file objects, and its succeeded jobs' results files. An upload is
spooled to disk as it arrives (the only body the gateway takes beyond JSON_MAX), then sent to the artifact
service, which checks every row and stores the file whole or not at all; the spooled copy is removed however the
request ends."""

from __future__ import annotations

import re
import secrets
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import aiofiles
from aiohttp import BodyPartReader, web

from schemas import names
from schemas.datasets import DatasetDeleted, DatasetInfo, DatasetList, DatasetListQuery, DatasetQuery
from schemas.datasets import DatasetUpload
from schemas.gateway import FileObject
from schemas.jobs import Error
from services import bus
from services.gateway.evals.items import ITEMS_PREFIX  # the items of eval runs: kept with the runs, not files
from services.gateway.errors import TENANT, OpenAIError, bad_request, json_response
from services.gateway.lookups import dataset_info
from services.gateway.paging import limit_of, page
from services.gateway.results import Results, is_results_file
from services.gateway.terms import openai_terms

SPOOL_CHUNK = 1 << 20
FIELD_MAX = 1024  # a form field other than the file (`purpose`)
FORM_SLACK = 64 * 1024  # a form's bytes beyond its file: boundaries, headers, `purpose`
PURPOSES = {"fine-tune": "auto", "evals": "evals"}  # a purpose and the dataset format its rows are checked as


@dataclass(frozen=True)
class UploadLimits:
    """What POST /v1/files takes: one file's bytes at most, and a tenant's files' bytes together (those stored,
    and those this gateway is receiving), each checked as the bytes arrive."""

    file_max: int = 512 * 2**20  # OpenAI's own limit of one file
    tenant_max: int = 10 * 2**30


def moment(stamp: str) -> float:
    """An object store's RFC 3339 time (nanoseconds and all) as Unix seconds; 0 when there is none."""
    if not stamp:
        return 0.0
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", stamp).replace("Z", "+00:00")).timestamp()


def file_object(d: DatasetInfo) -> FileObject:
    return FileObject(
        id=d.name,
        bytes=d.size,
        created_at=int(moment(d.created)),
        filename=d.description or d.name,
        purpose="evals" if d.stats.format == "evals" else "fine-tune",
    )


async def small_field(part: BodyPartReader, name: str) -> str:
    """A form field read whole only while it is small."""
    data = bytearray()
    while chunk := await part.read_chunk(FIELD_MAX):
        data += chunk
        if len(data) > FIELD_MAX:
            raise bad_request(f"the form field `{name}` is over {FIELD_MAX} bytes; it takes a short word", name)
    return data.decode(errors="replace").strip()


class Files:
    """The handlers; `tenant` comes from the request's key, never from its body."""

    def __init__(
        self, nc, results: Results, spool_dir: str | None = None, limits: UploadLimits = UploadLimits()
    ) -> None:
        self.nc, self.results, self.spool_dir, self.limits = nc, results, spool_dir, limits
        self.receiving: dict[str, int] = {}  # bytes of each tenant's uploads this gateway is spooling now

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/files", self.create),
            web.get("/v1/files", self.list),
            web.get("/v1/files/{id}", self.retrieve),
            web.delete("/v1/files/{id}", self.delete),
            web.get("/v1/files/{id}/content", self.content),
        ]

    async def create(self, request: web.Request) -> web.Response:
        tenant = request[TENANT]
        if not request.content_type.startswith("multipart/"):
            raise bad_request("upload the file as multipart/form-data with fields `purpose` and `file`", "file")
        if request.content_length is not None and request.content_length > self.limits.file_max + FORM_SLACK:
            raise self._too_large()
        reader = await request.multipart()
        purpose, path, filename, held = None, None, "", 0
        try:
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise bad_request("a form field is itself multipart; send `purpose` and `file` as plain fields")
                if part.name == "purpose":
                    purpose = await small_field(part, "purpose")
                elif part.name == "file":
                    if path is not None:
                        raise bad_request("the form holds more than one `file`; upload one file a request", "file")
                    filename = part.filename or "upload.jsonl"
                    path, held = await self._spool(part, tenant)  # removes what it wrote if the upload fails
            if purpose not in PURPOSES:
                raise bad_request(
                    f"purpose {purpose!r} is not served here; this API takes purpose 'fine-tune' (training data) or "
                    "'evals' (an eval's items and samples)",
                    "purpose",
                )
            if path is None:
                raise bad_request("the form has no `file` field; send the JSON-lines file as `file`", "file")
            ident = f"file-{secrets.token_hex(12)}"
            upload = DatasetUpload(format=PURPOSES[purpose], description=filename[:1000])  # type: ignore[arg-type]
            from services.transfer.sender import Refusal, upload_dataset

            try:
                info = await upload_dataset(self.nc, ident, path, upload, tenant=tenant)
            except Refusal as e:
                raise bad_request(f"{filename}: {e}", "file", "invalid_file") from None
            return json_response(file_object(info))
        finally:
            self._received(tenant, held)  # stored now, or not at all
            if path is not None:
                Path(path).unlink(missing_ok=True)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(
            413,
            f"file: the file is over {self.limits.file_max:,} bytes, the most one file may be here (the operator's "
            "jetlora gateway --file-max-mib); split it into files under that",
            "file",
            "file_too_large",
        )

    async def _room(self, tenant: str) -> int:
        """Bytes the tenant's upload may still take: its stored files and its other uploads under way count."""
        reply = await bus.request(self.nc, names.datasets_api(tenant).list, DatasetListQuery(), DatasetList)
        stored = sum(d.size for d in reply.datasets)
        return self.limits.tenant_max - stored - self.receiving.get(tenant, 0)

    def _over_quota(self, tenant: str) -> OpenAIError:
        return OpenAIError(
            413,
            f"file: your files would come to more than {self.limits.tenant_max:,} bytes, your quota of stored files "
            "(the operator's jetlora gateway --tenant-files-mib), counting the uploads of yours under way; delete "
            "files you no longer need (DELETE /v1/files/{id}), then upload again",
            "file",
            "quota_exceeded",
        )

    async def _spool(self, part: BodyPartReader, tenant: str) -> tuple[str, int]:
        """The file part in a spool file, and its size, which stays counted as the tenant's upload under way until
        the caller calls _received; each chunk is counted against both limits as it arrives: past either, the spool
        file is removed and the upload refused (413) without reading on."""
        room = await self._room(tenant)
        with tempfile.NamedTemporaryFile(
            dir=self.spool_dir, prefix="jetlora-upload-", suffix=".jsonl", delete=False
        ) as f:
            path = f.name
        size = 0
        try:
            async with aiofiles.open(path, "wb") as out:
                while chunk := await part.read_chunk(SPOOL_CHUNK):
                    size += len(chunk)
                    self.receiving[tenant] = self.receiving.get(tenant, 0) + len(chunk)
                    if size > self.limits.file_max:
                        raise self._too_large()
                    if size > room:
                        raise self._over_quota(tenant)
                    await out.write(chunk)
        except BaseException:  # over a limit, the client went away mid-file, or the request was cancelled
            Path(path).unlink(missing_ok=True)
            self._received(tenant, size)
            raise
        return path, size

    def _received(self, tenant: str, size: int) -> None:
        left = self.receiving.get(tenant, 0) - size
        if left > 0:
            self.receiving[tenant] = left
        else:
            self.receiving.pop(tenant, None)

    async def list(self, request: web.Request) -> web.Response:
        """OpenAI's files.list: `order` by creation (desc by default), `limit` (up to 10,000), `after` an id,
        `purpose`. The tenant's datasets (results files are reached through their jobs' result_files)."""
        limit, order = limit_of(request, 10_000, most=10_000), request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', not {order!r}", "order")
        reply = await bus.request(self.nc, names.datasets_api(request[TENANT]).list, DatasetListQuery(), DatasetList)
        datasets = sorted(reply.datasets, key=lambda d: (moment(d.created), d.name), reverse=order == "desc")
        purpose = request.query.get("purpose")
        files = [file_object(d) for d in datasets if not d.name.startswith(ITEMS_PREFIX)]
        files = [f for f in files if purpose is None or f.purpose == purpose]
        return json_response(page(files, request.query.get("after"), limit, "file of yours"))

    async def retrieve(self, request: web.Request) -> web.Response:
        tenant, ident = request[TENANT], request.match_info["id"]
        if is_results_file(ident):
            return json_response(await self.results.file(tenant, ident))
        return json_response(file_object(await dataset_info(self.nc, tenant, ident)))

    async def delete(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        if is_results_file(ident):
            await self.results.summary(request[TENANT], ident)  # a 404 unless it is the tenant's
            raise bad_request(
                "a results file is rendered from its job's events on request and stores nothing; it goes with the job",
                "file_id",
            )
        await dataset_info(self.nc, request[TENANT], ident)
        reply = await bus.request(
            self.nc, names.datasets_api(request[TENANT]).delete, DatasetQuery(name=ident), DatasetDeleted | Error
        )
        if isinstance(reply, Error):  # unfinished jobs train on it
            raise OpenAIError(409, openai_terms(reply.error), "file_id", "file_in_use")
        return json_response({"id": ident, "object": "file", "deleted": True})

    async def content(self, request: web.Request) -> web.Response:
        tenant, ident = request[TENANT], request.match_info["id"]
        if is_results_file(ident):
            return web.Response(body=await self.results.content(tenant, ident), content_type="text/csv")
        await dataset_info(self.nc, tenant, ident)
        raise bad_request("Not allowed to download files of purpose: fine-tune.", "file_id", "forbidden_download")
