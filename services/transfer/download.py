"""Fetch an artifact from the object store to disk, verified; unpack adapter archives safely."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import tarfile
import tempfile
from pathlib import Path

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from schemas import names, nats_subjects
from schemas.artifacts import ArtifactInfo
from schemas.object_headers import info_from_object


class DownloadError(Exception):
    pass


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


async def stored_name(obs, job: str, kind: str) -> str:
    """The object-store name of a job's artifact of `kind`: for checkpoints, the newest one's."""
    if kind != "checkpoint":
        return names.artifact_name(job, kind)
    try:
        objects = await obs.list(ignore_deletes=True)
    except NotFoundError:
        objects = []
    mine = [a for a in map(info_from_object, objects) if a and a.job == job and a.kind == kind and a.step is not None]
    if not mine:
        raise DownloadError(f"no checkpoint for job {job}; `jetlora artifacts ls --job {job}` lists what it has")
    return max(mine, key=lambda a: a.step or 0).name


async def download(nc: Client, job: str, kind: str, output: str | os.PathLike) -> ArtifactInfo:
    """Stream `job/kind` into `output` (written beside it, then renamed): all or nothing, sha256 checked. For
    checkpoints, the newest one."""
    names.check_token(job, "job id")
    obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    return await download_named(nc, await stored_name(obs, job, kind), output)


async def download_named(nc: Client, name: str, output: str | os.PathLike) -> ArtifactInfo:
    """Stream the artifact stored under `name` into `output`, sha256 checked."""
    obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    try:
        obj = await obs.get_info(name)
    except NotFoundError:
        job = name.split("/", 1)[0]
        raise DownloadError(f"no artifact {name}; `jetlora artifacts ls --job {job}` lists what it has") from None
    info = info_from_object(obj)
    if info is None:
        raise DownloadError(f"{name} is not a jetlora artifact")
    await fetch_object(nc.jetstream(), names.ARTIFACTS_BUCKET, name, output, info.sha256)
    return info


SMALL_OBJECT_CHUNKS = 8  # objects of up to this many chunks are read with one stream lookup a chunk, no consumer


async def fetch_object(js, bucket: str, name: str, output: str | os.PathLike, sha256: str) -> None:
    """Stream one object into `output` (written beside it, then renamed): all or nothing, its sha256 checked.

    A small object (an adapter, say, fetched by a whole fleet at once) is read chunk by chunk with next-by-subject
    lookups, which spares the server a consumer per reader; a large one through nats-py's ordered consumer."""
    obs = await js.object_store(bucket)
    info = await obs.get_info(name)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if (info.chunks or 0) <= SMALL_OBJECT_CHUNKS:
                got = await _read_chunks(js, bucket, info, f)
            else:
                await obs.get(name, writeinto=f)  # writeinto: linear time (nats-py's in-memory get is quadratic)
                got = ""
        got = got or await asyncio.to_thread(sha256_file, tmp)
        if got != sha256:
            raise DownloadError(f"{name} arrived with sha256 {got}, expected {sha256}; try again")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def fetch_small(js, bucket: str, name: str, sha256: str) -> bytes | None:
    """An object of at most SMALL_OBJECT_CHUNKS chunks, in memory, its sha256 checked as its chunks arrive (no file,
    no second pass, no thread); None when it is larger (fetch_object it)."""
    info = await (await js.object_store(bucket)).get_info(name)
    if (info.chunks or 0) > SMALL_OBJECT_CHUNKS:
        return None
    buffer = io.BytesIO()
    got = await _read_chunks(js, bucket, info, buffer)
    if got != sha256:
        raise DownloadError(f"{name} arrived with sha256 {got}, expected {sha256}; try again")
    return buffer.getvalue()


async def _read_chunks(js, bucket: str, info, f) -> str:
    """Write the object's chunks into f in order; returns their sha256 (hex)."""
    digest = hashlib.sha256()
    store = nats_subjects.objects(bucket)
    subject, seq = store.chunks(info.nuid), 0
    for n in range(info.chunks or 0):
        try:
            msg = await js.get_msg(store.stream, seq=seq + 1, subject=subject, next=True, direct=True)
        except NotFoundError:
            raise DownloadError(
                f"{info.name} has {n} of its {info.chunks} chunks in the store; it is damaged"
            ) from None
        f.write(msg.data)
        digest.update(msg.data)
        seq = msg.seq
    return digest.hexdigest()


def safe_extract(archive: str | os.PathLike | bytes, dest: str | os.PathLike) -> Path:
    """Unpack a tar.gz (a file, or its bytes), refusing members that would land outside `dest` or that are links or
    devices."""
    dest = Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    opened = (
        tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz")
        if isinstance(archive, bytes)
        else tarfile.open(archive, "r:gz")
    )
    with opened as tar:
        for m in tar.getmembers():
            target = (dest / m.name).resolve()
            if m.name.startswith("/") or ".." in Path(m.name).parts or not target.is_relative_to(dest):
                raise DownloadError(f"archive member {m.name!r} points outside the target directory; refusing it")
            if not (m.isfile() or m.isdir()):
                raise DownloadError(f"archive member {m.name!r} is a link or device; refusing it")
        tar.extractall(dest, filter="data")
    return dest
