"""/v1/files: a tenant's datasets as OpenAI file objects. An upload is spooled to disk as it arrives, then sent
to the artifact service, which checks every row and stores the file whole or not at all."""

from __future__ import annotations

import re
import secrets
import tempfile
from datetime import datetime
from pathlib import Path

import aiofiles
from aiohttp import BodyPartReader, web

from schemas import names
from schemas.datasets import DatasetDeleted, DatasetInfo, DatasetList, DatasetListQuery, DatasetQuery, DatasetReply
from schemas.datasets import DatasetUpload
from schemas.gateway import FileObject, Page
from schemas.jobs import Error
from services import bus
from services.gateway.errors import TENANT, is_token, OpenAIError, bad_request, json_response, not_found

SPOOL_CHUNK = 1 << 20


def epoch(stamp: str) -> int:
    """An object store's RFC 3339 time (nanoseconds and all) as Unix seconds; 0 when there is none."""
    if not stamp:
        return 0
    return int(datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", stamp).replace("Z", "+00:00")).timestamp())


def file_object(d: DatasetInfo) -> FileObject:
    return FileObject(id=d.name, bytes=d.size, created_at=epoch(d.created), filename=d.description or d.name)


class Files:
    """The handlers; `tenant` comes from the request's key, never from its body."""

    def __init__(self, nc, spool_dir: str | None = None) -> None:
        self.nc, self.spool_dir = nc, spool_dir

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/files", self.create),
            web.get("/v1/files", self.list),
            web.get("/v1/files/{id}", self.retrieve),
            web.delete("/v1/files/{id}", self.delete),
            web.get("/v1/files/{id}/content", self.content),
        ]

    async def info(self, tenant: str, ident: str, param: str | None = None) -> DatasetInfo:
        if not is_token(ident):
            raise not_found("file", ident, param)
        reply = await bus.request(
            self.nc, names.datasets_api(tenant).show, DatasetQuery(name=ident), DatasetReply | Error
        )
        if isinstance(reply, Error):
            raise not_found("file", ident, param)
        return reply.dataset

    async def create(self, request: web.Request) -> web.Response:
        tenant = request[TENANT]
        if not request.content_type.startswith("multipart/"):
            raise bad_request("upload the file as multipart/form-data with fields `purpose` and `file`", "file")
        reader = await request.multipart()
        purpose, path, filename = None, None, ""
        try:
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise bad_request("a form field is itself multipart; send `purpose` and `file` as plain fields")
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    path = await self._spool(part)
            if purpose != "fine-tune":
                raise bad_request(
                    f"purpose {purpose!r} is not served here; this API takes purpose 'fine-tune'", "purpose"
                )
            if path is None:
                raise bad_request("the form has no `file` field; send the JSON-lines file as `file`", "file")
            ident = f"file-{secrets.token_hex(12)}"
            upload = DatasetUpload(description=filename[:1000])
            from services.artifacts.sender import Refusal, upload_dataset

            try:
                info = await upload_dataset(self.nc, ident, path, upload, tenant=tenant)
            except Refusal as e:
                raise bad_request(f"{filename}: {e}", "file", "invalid_file") from None
            return json_response(file_object(info))
        finally:
            if path is not None:
                Path(path).unlink(missing_ok=True)

    async def _spool(self, part) -> str:
        with tempfile.NamedTemporaryFile(
            dir=self.spool_dir, prefix="jetlora-upload-", suffix=".jsonl", delete=False
        ) as f:
            path = f.name
        async with aiofiles.open(path, "wb") as out:
            while chunk := await part.read_chunk(SPOOL_CHUNK):
                await out.write(chunk)
        return path

    async def list(self, request: web.Request) -> web.Response:
        reply = await bus.request(self.nc, names.datasets_api(request[TENANT]).list, DatasetListQuery(), DatasetList)
        files = sorted((file_object(d) for d in reply.datasets), key=lambda f: -f.created_at)
        return json_response(
            Page(data=files, first_id=files[0].id if files else None, last_id=files[-1].id if files else None)
        )

    async def retrieve(self, request: web.Request) -> web.Response:
        return json_response(file_object(await self.info(request[TENANT], request.match_info["id"])))

    async def delete(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        await self.info(request[TENANT], ident)
        reply = await bus.request(
            self.nc, names.datasets_api(request[TENANT]).delete, DatasetQuery(name=ident), DatasetDeleted | Error
        )
        if isinstance(reply, Error):  # unfinished jobs train on it
            raise OpenAIError(409, reply.error, "file_id", "file_in_use")
        return json_response({"id": ident, "object": "file", "deleted": True})

    async def content(self, request: web.Request) -> web.Response:
        await self.info(request[TENANT], request.match_info["id"])
        raise bad_request("Not allowed to download files of purpose: fine-tune.", "file_id", "forbidden_download")
