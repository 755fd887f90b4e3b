"""Co-training: which jobs may share one trainer process (and so one copy of the base model) on a device, and what
such a group holds in memory. The scheduler groups by these rules, the CLI estimates by them, the trainer's group
process checks the same identity of the weights.

A group trains jobs of one base model (equal weights by `weights_digest`, else the same directory), precision and
quantisation, on one device; sft and dpo jobs only, each starting from a fresh adapter; no job asks to train alone.
Which tenants' jobs may share a process is the operator's policy (`--co-train`)."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Literal

from msgspec import Struct

from schemas.memory import ALLOCATOR_MARGIN, Estimate, ModelShape, estimate

CoTrainPolicy = Literal["off", "same-tenant", "any"]
CO_TRAIN_POLICIES: tuple[CoTrainPolicy, ...] = ("off", "same-tenant", "any")
METHODS = ("sft", "dpo")  # what a group trains
GroupKey = tuple[str, str, str]  # (weights, precision, quantization)


def why_alone(request) -> str | None:
    """Why a JobRequest trains in a process of its own whatever the policy, or None when it may join a group."""
    t = request.train
    if not request.co_train:
        return "it asked to train alone (co_train: false)"
    if request.devices > 1:
        return "it trains on several devices"
    if t.method not in METHODS:
        return f"train.method {t.method} is not co-trained (a group trains {' and '.join(METHODS)})"
    if request.init_adapter is not None:
        return "it starts from init_adapter"
    if request.served_by == "llamacpp":
        return "it is exported to GGUF for llama.cpp, which a group does not do"
    if t.gradient_checkpointing:
        return "it asks for gradient checkpointing, which a group does not do"
    return None


def group_key(request, shape: ModelShape | None) -> GroupKey:
    """What jobs of one group share: the base weights (by digest where the node advertised it), precision and
    quantisation."""
    weights = shape.digest if shape is not None and shape.digest else "dir:" + request.base_dir.rstrip("/")
    return (weights, request.train.precision, request.quantization)


class GroupEstimate(Struct, kw_only=True):
    """A group's predicted peak: the base once, and each job's own adapter, optimizer, activations and logits."""

    mib: int
    base_mib: int  # the frozen weights (with the allocator's margin) and the CUDA context, held once
    own_mib: list[int]  # each job's own part, in the order given


def own_mib(need: Estimate) -> int:
    """The part of a job's estimate that is its own in a group: all but the base weights and the CUDA context."""
    return max(0, need.mib - shared_mib(need))


def shared_mib(need: Estimate) -> int:
    return math.ceil(need.weights_mib * ALLOCATOR_MARGIN) + need.overhead_mib


def group_estimate(shape: ModelShape, requests: list, device: str = "cuda") -> GroupEstimate:
    """The peak of training `requests` (JobRequests) together in one group on one device of `device` kind."""
    needs = [estimate(shape, r, device) for r in requests]
    base = max((shared_mib(n) for n in needs), default=0)
    own = [own_mib(n) for n in needs]
    return GroupEstimate(mib=base + sum(own), base_mib=base, own_mib=own)


def weights_digest(directory: str) -> str:
    """The identity of a model directory's weights without reading them: sha256 over config.json and each
    safetensors file's name, size and header (tensor names, shapes, dtypes and offsets). Two directories with equal
    digests hold the same model as far as training can tell without hashing gigabytes; '' when unreadable."""
    path, h = Path(directory), hashlib.sha256()
    try:
        h.update((path / "config.json").read_bytes())
        for file in sorted(path.glob("*.safetensors")):
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            h.update(file.name.encode() + b"\0" + str(file.stat().st_size).encode() + b"\0")
            h.update(json.dumps(header, sort_keys=True).encode())
    except (OSError, ValueError, struct.error):
        return ""
    return "sha256:" + h.hexdigest()


def same_weights(a: str, b: str) -> bool:
    """Whether two model directories hold the same weights (the same path, or equal digests)."""
    if a.rstrip("/") == b.rstrip("/"):
        return True
    da = weights_digest(a)
    return bool(da) and da == weights_digest(b)


__all__ = [
    "CO_TRAIN_POLICIES",
    "CoTrainPolicy",
    "GroupEstimate",
    "GroupKey",
    "METHODS",
    "group_estimate",
    "group_key",
    "own_mib",
    "same_weights",
    "shared_mib",
    "weights_digest",
    "why_alone",
]
