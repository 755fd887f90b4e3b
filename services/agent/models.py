"""The base models a node has: their shapes, read from config.json and the safetensors headers (no weights are
loaded), go into heartbeats so the scheduler can size `gpu_mib: 0` jobs before placing them; and each one's content
digest (schemas/weights_digest.py), by which the scheduler keys co-training groups. The digest reads every byte of
the base, so a thread of its own computes it after the agent starts (heartbeats carry it once it is known, "" until
then) and looks again every REFRESH_S (a stat per file; a changed file is hashed again). DIGESTS keeps each file's
digest for the agent's life: a job joining a group has its base's digest from it (services/agent/group_run.py)."""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from pathlib import Path

from schemas.memory import ModelShape
from schemas.weights_digest import FileDigests

log = logging.getLogger(__name__)
DIGESTS = FileDigests()  # this agent's: each file of a base hashed once while it stays as it is
REFRESH_S = 30.0


def safetensors_params(directory: Path) -> int:
    """Parameters in the directory's safetensors files, from their headers."""
    total = 0
    for path in directory.glob("*.safetensors"):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                total += count
    return total


def read_shape(directory: str) -> ModelShape:
    """A model directory's shape; ValueError saying what is wrong with it."""
    path = Path(directory)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{directory}: no readable config.json ({e})") from None
    try:
        shape = ModelShape.from_config(str(path), config, safetensors_params(path) or None)
    except (KeyError, ValueError, TypeError, struct.error) as e:
        raise ValueError(f"{directory}: config.json or the safetensors headers are not a decoder's ({e!r})") from None
    return shape


def read_shapes(directories: list[str]) -> list[ModelShape]:
    """The shapes of the models given to the agent; one that cannot be read is left out, with a warning. Their
    digests are filled in by a thread started here (digest_forever)."""
    shapes = []
    for directory in directories:
        try:
            shapes.append(read_shape(directory))
        except ValueError as e:
            log.warning("model %s is not advertised: %s; `gpu_mib: 0` jobs on it get any free GPU", directory, e)
    if shapes:
        threading.Thread(target=digest_forever, args=(shapes,), name="base-digests", daemon=True).start()
    return shapes


def digest_forever(shapes: list[ModelShape], every_s: float = REFRESH_S) -> None:
    """Each shape's digest, set as soon as it is computed and again whenever its files change."""
    while True:
        for shape in shapes:
            refresh_digest(shape)
        time.sleep(every_s)


def refresh_digest(shape: ModelShape, warned: set[str] = set()) -> None:  # noqa: B006 (once per directory)
    """The shape's digest from its files as they are now ("" and a warning, once, when they cannot be read)."""
    started, before = time.monotonic(), DIGESTS.hashed_bytes
    try:
        digest = DIGESTS.directory(shape.dir)
    except (OSError, ValueError) as e:
        if shape.dir not in warned:
            warned.add(shape.dir)
            log.warning(
                "model %s: its content could not be hashed (%s); its jobs co-train only with jobs of the same "
                "directory on this node until it can",
                shape.dir,
                e,
            )
        shape.digest = ""
        return
    warned.discard(shape.dir)
    if digest != shape.digest:
        read = (DIGESTS.hashed_bytes - before) / 2**20
        took = time.monotonic() - started
        log.info("model %s: content digest %s (%.0f MiB hashed in %.1fs)", shape.dir, digest[:19], read, took)
        shape.digest = digest
