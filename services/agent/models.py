"""The base models a node has: their shapes, read from config.json and the safetensors headers (no weights are
loaded), go into heartbeats so the scheduler can size `gpu_mib: 0` jobs before placing them."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

from schemas.co_train import weights_digest
from schemas.memory import ModelShape

log = logging.getLogger(__name__)


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
    shape.digest = weights_digest(directory)  # jobs co-train only on equal weights
    return shape


def read_shapes(directories: list[str]) -> list[ModelShape]:
    """The shapes of the models given to the agent; one that cannot be read is left out, with a warning."""
    shapes = []
    for directory in directories:
        try:
            shapes.append(read_shape(directory))
        except ValueError as e:
            log.warning("model %s is not advertised: %s; `gpu_mib: 0` jobs on it get any free GPU", directory, e)
    return shapes
