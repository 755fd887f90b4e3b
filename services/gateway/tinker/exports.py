"""save_weights_external's exports, downloaded: an export is the adapter's PEFT files stored as a sampler save is (in
the artifacts bucket, under the name schemas.tinker_store.stored_name gives it, counted with the tenant's named
sampler saves), and RestClient.get_external_weights_urls answers one URL per file, as the cookbook's
weights.download fetches them (plain GETs, no header). A URL opens only with the signature it carries: an HMAC, made
with the stored digest of the very key that asked for it, of that key's id, the export's path, the file and when
the URL expires (EXPIRES_S); a key deleted, or another tenant's export, opens nothing. Each GET streams the one file
from the stored archive; an export saved with age_encryption_recipients lists each file as NAME.age and streams it
encrypted to them (age.py), as the cookbook's weights.download of a weights/ path asks and decrypts."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import tarfile
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

from schemas.tinker_store import EXPORTED, SamplerSave
from services.gateway.tinker import age
from services.gateway.tinker.common import PREFIX, Ctx
from services.gateway.tinker.http import TINKER_PREFIX, TinkerRefusal, reply
from services.gateway.tinker.paths import tinker_path
from services.transfer.download import download_named

EXPIRES_S = 3600  # how long a signed URL opens its file
CHUNK = 1 << 20


def age_recipients(value: object) -> list[str]:
    """save_weights_external's age_encryption_recipients, checked (none: the files are served as they are)."""
    if value is None or value == []:
        return []
    try:
        return age.recipients(value)
    except ValueError as e:
        raise TinkerRefusal(400, f"age_encryption_recipients: {e}") from None


def signature(digest: str, ident: str, path: str, file: str, expires: int) -> str:
    return hmac.new(digest.encode(), f"{ident}\n{path}\n{file}\n{expires}".encode(), hashlib.sha256).hexdigest()


class Exports:
    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.listed: dict[str, list[str]] = {}  # an archive's files, by its sha256

    def routes(self) -> list[web.RouteDef]:
        run = PREFIX + "/training_runs/{id}/checkpoints/external_weights/{name}"
        return [
            web.get(run + "/external_weights_urls", self.urls),
            web.get(PREFIX + "/external_weights/{id}/{name}/{file}", self.file),
        ]

    async def urls(self, request: web.Request) -> web.Response:
        """One signed URL per file of the caller's export."""
        ctx = self.ctx
        tenant = await ctx.tenant(request)
        path = tinker_path(request.match_info["id"], "external_weights", request.match_info["name"])
        save = await ctx.saves.find(tenant, path)
        if save is None:
            raise TinkerRefusal(404, f"no external weights {path[:200]!r} of yours (deleted, or its TTL passed)")
        key = request.headers.get("X-API-Key", "").strip().removeprefix(TINKER_PREFIX)
        ident = key.split("-", 2)[1] if key.count("-") >= 2 else ""
        record = await ctx.keys.record(ident)
        if record is None or record.tenant != tenant:
            raise TinkerRefusal(401, "the URLs are signed for the key that asks: give your own TINKER_API_KEY")
        expires = int(time.time()) + EXPIRES_S
        base = f"{request.scheme}://{request.host}{PREFIX}/external_weights/{quote(save.model)}/{quote(save.name)}"
        suffix = age.SUFFIX if save.age_recipients else ""  # served encrypted: named as age names them
        urls = {
            file: f"{base}/{quote(file)}?key={ident}&expires={expires}&sig="
            + signature(record.secret_sha256, ident, save.path, file, expires)
            for file in [name + suffix for name in await self._files(save)]
        }
        return reply({"urls": urls, "expires": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))})

    async def file(self, request: web.Request) -> web.StreamResponse:
        """One file of an export, for a URL `urls` signed and that has not expired."""
        ctx, q = self.ctx, request.query
        model, name, file = request.match_info["id"], request.match_info["name"], request.match_info["file"]
        ident, sig, expires = q.get("key", ""), q.get("sig", ""), q.get("expires", "")
        record = await ctx.keys.record(ident) if ident.isalnum() else None
        refused = TinkerRefusal(403, "this URL is not signed, or no longer opens: ask get_external_weights_urls again")
        if record is None or not _timestamp(expires) or int(expires) < time.time():
            raise refused
        save = await ctx.saves.find(record.tenant, tinker_path(model, "external_weights", name.removeprefix(EXPORTED)))
        if save is None or save.name != name:
            raise refused
        if not hmac.compare_digest(sig, signature(record.secret_sha256, ident, save.path, file, int(expires))):
            raise refused
        recipients = save.age_recipients
        if recipients and not file.endswith(age.SUFFIX):
            raise refused
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "export.tar.gz"
            await download_named(ctx.store.nc, save.object, archive)
            return await _stream(request, archive, file.removesuffix(age.SUFFIX) if recipients else file, refused,
                                 recipients)  # fmt: skip

    async def _files(self, save: SamplerSave) -> list[str]:
        files = self.listed.get(save.sha256)
        if files is None:
            with tempfile.TemporaryDirectory() as tmp:
                archive = Path(tmp) / "export.tar.gz"
                await download_named(self.ctx.store.nc, save.object, archive)
                files = await asyncio.to_thread(_members, archive)
            self.listed[save.sha256] = files
            while len(self.listed) > 256:
                del self.listed[next(iter(self.listed))]
        return files


def _timestamp(value: str) -> bool:
    """A whole number of seconds as a signed URL carries one (ASCII digits, a date before the year 33658)."""
    return value.isascii() and value.isdigit() and len(value) <= 12


def _members(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return sorted(m.name.removeprefix("./") for m in tar.getmembers() if m.isfile())


async def _stream(request: web.Request, archive: Path, file: str, refused: TinkerRefusal,
                  recipients: list[str]) -> web.StreamResponse:  # fmt: skip
    """The archive's one file, as it is or age-encrypted to `recipients` (its length then not known ahead)."""
    tar = await asyncio.to_thread(tarfile.open, archive)
    try:
        member = next((m for m in tar.getmembers() if m.isfile() and m.name.removeprefix("./") == file), None)
        source = tar.extractfile(member) if member is not None else None
        if member is None or source is None:
            raise refused
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        pieces = iter(lambda: source.read(CHUNK), b"")
        if recipients:
            pieces = age.encrypt(recipients, pieces)
        else:
            response.content_length = member.size
        await response.prepare(request)
        while (chunk := await asyncio.to_thread(next, pieces, b"")) != b"":
            await response.write(chunk)
        await response.write_eof()
        return response
    finally:
        tar.close()
