"""A training session's named sampler saves in the object store (the artifact kind "sampler", one object per name:
names.sampler_save_object), never in the session's memory or checkpoint: uploaded through the artifact service (which
binds it to the job's current attempt and tenant) once the trainer has written it, and fetched back onto this node
when a sample asks for one that is not here (a session resumed elsewhere, or after a pause)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from pathlib import Path

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from schemas import names
from schemas.artifacts import ArtifactMeta
from schemas.object_headers import info_from_object
from schemas.sessions import CallError, Sample, SavedResult, SaveWeights, SessionCall, SessionReply, stored_sampler
from services import __version__
from services.agent.shipping import tar_dir
from services.transfer.download import download_named, safe_extract
from services.transfer.sender import upload_file

log = logging.getLogger(__name__)
WEIGHTS_FILE = "adapter_model.safetensors"


def stored(call: SessionCall) -> bool:
    """A call that reaches the object store: a named sampler save, or a sample of one."""
    return isinstance(call, SaveWeights | Sample) and call.stored


class SamplerSaves:
    def __init__(self, nc: Client, node: str) -> None:
        self.nc, self.node = nc, node
        self._fetching: dict[str, asyncio.Lock] = {}

    async def before(self, run, call: SessionCall) -> CallError | None:
        """A sample of a stored save finds its files on this node (fetched if need be); why not, if not."""
        if not isinstance(call, Sample) or not call.stored or call.weights is None:
            return None
        where = Path(stored_sampler(run.trainer.spec.out_dir, call.weights))
        lock = self._fetching.setdefault(str(where), asyncio.Lock())
        async with lock:
            if (where / WEIGHTS_FILE).is_file():
                return None
            job = run.assignment.job
            try:
                if call.object:  # another job's save (a serving sampler's call): only ever one of this tenant's
                    await _same_tenant(self.nc, call.object, run.assignment.tenant)
                await _fetch(self.nc, call.object or names.sampler_save_object(job, call.weights), where)
            except Exception as e:  # not stored (DownloadError says so), or the store away
                return CallError(
                    message=f"sampler weights {call.weights!r} could not be fetched: {e}", field="model_path"
                )
            finally:
                if not lock._waiters:  # type: ignore[attr-defined]
                    self._fetching.pop(str(where), None)
            log.info("job %s: sampler save %s fetched from the object store", job, call.weights)
        return None

    async def after(self, run, call: SessionCall, reply: SessionReply) -> SessionReply:
        """A stored save the trainer answered is in the object store before the gateway hears of it (the answer
        names the object); one the trainer answered as a call it ran before (sent again) may be there already."""
        if not (isinstance(call, SaveWeights) and call.stored and isinstance(reply, SavedResult)):
            return reply
        a, name = run.assignment, names.sampler_save_object(run.assignment.job, call.name)
        where = Path(stored_sampler(run.trainer.spec.out_dir, call.name))
        if not (where / WEIGHTS_FILE).is_file():  # answered as a call it ran before: stored then, if at all
            return await self._stored_before(reply, name)
        with tempfile.TemporaryDirectory(dir=where.parent) as tmp:
            archive = Path(tmp) / "sampler.tar.gz"
            await asyncio.to_thread(tar_dir, where, archive)
            meta = ArtifactMeta(base_model=a.request.model, trainer_version=__version__, tenant=a.tenant or "",
                                filename=f"{a.job}-sampler-{call.name}.tar.gz", attempt=a.attempt, save=call.name,
                                summary=f"sampler save {call.name} at step {reply.step}")  # fmt: skip
            try:
                info = await upload_file(self.nc, self.node, a.job, "sampler", archive, meta)
            except Exception as e:  # refused (a superseded attempt) or the store away: the save did not happen
                return CallError(message=f"the sampler save {call.name!r} was not stored ({e}); save it again")
        return SavedResult(name=reply.name, kind=reply.kind, step=reply.step, object=name, sha256=info.sha256,
                           size=info.size)  # fmt: skip

    async def _stored_before(self, reply: SavedResult, name: str) -> SessionReply:
        try:
            info = info_from_object(
                await (await self.nc.jetstream().object_store(names.ARTIFACTS_BUCKET)).get_info(name)
            )
        except NotFoundError:
            info = None
        if info is None:
            return CallError(message=f"the sampler save {reply.name!r} was made but never stored; save it again")
        return SavedResult(name=reply.name, kind=reply.kind, step=reply.step, object=name, sha256=info.sha256,
                           size=info.size)  # fmt: skip


async def _same_tenant(nc: Client, name: str, tenant: str | None) -> None:
    store = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    info = info_from_object(await store.get_info(name))
    if info is None or info.tenant != (tenant or ""):
        raise PermissionError(f"{name} is not an object of this job's tenant")


async def _fetch(nc: Client, name: str, where: Path) -> None:
    """The stored archive, unpacked beside `where` and moved into place whole."""
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where.parent) as tmp:
        archive = Path(tmp) / "sampler.tar.gz"
        await download_named(nc, name, archive)
        unpacked = await asyncio.to_thread(safe_extract, archive, Path(tmp) / "files")
        shutil.rmtree(where, ignore_errors=True)
        Path(unpacked).replace(where)
