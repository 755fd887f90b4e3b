"""Co-training: which jobs may share one trainer process (and so one copy of the base model) on a device, and what
such a group holds in memory. The scheduler groups by these rules, the CLI estimates by them, the trainer's group
process checks the same identity of the weights.

A group trains jobs of one base model (equal content by schemas/weights_digest.py where the node advertised its
digest, else the same directory on the node; the group's process compares the digests itself either way),
precision and quantisation, and one yield rule (request.priority, which with the tenant decides whether a job gives
way to a serving engine), on one device; sft and dpo jobs only, each starting from a fresh adapter; no job asks to
train alone, and none was split out of a group for memory (JobStatus.train_alone). Which tenants' jobs may share a
process is the operator's policy (`--co-train`).

Tinker training sessions (train.method session) share a process the same way, with sessions only (a session group,
trainer/session/group.py: each session a member with its own adapter, optimizer, random state and saves, a base
model's sampler a member with its adapter off): the group key says which process a group runs. A session starts a
group even alone, so that the next session of its kind (its tenant's base sampler, another training client) joins
it on its device instead of waiting for the device the first holds as long as its client uses it."""

from __future__ import annotations

import math
from typing import Literal

from msgspec import Struct

from schemas.memory import ALLOCATOR_MARGIN, Estimate, ModelShape, estimate

CoTrainPolicy = Literal["off", "same-tenant", "any"]
CO_TRAIN_POLICIES: tuple[CoTrainPolicy, ...] = ("off", "same-tenant", "any")
METHODS = ("sft", "dpo")  # what a group trains
SESSION = "session"  # train.method of a Tinker session: grouped with sessions only
GroupKey = tuple[str, str, str, int, str]  # (weights, precision, quantization, priority: the yield rule, process)


def why_alone(request) -> str | None:
    """Why a JobRequest trains in a process of its own whatever the policy, or None when it may join a group."""
    t = request.train
    if not request.co_train:
        return "it asked to train alone (co_train: false)"
    if request.devices > 1:
        return "it trains on several devices"
    if t.method not in METHODS and t.method != SESSION:
        return f"train.method {t.method} is not co-trained (a group trains {' and '.join(METHODS)}, or sessions)"
    if request.init_adapter is not None and t.method != SESSION:  # a session loads its start as a member
        return "it starts from init_adapter"
    if request.served_by == "llamacpp":
        return "it is exported to GGUF for llama.cpp, which a group does not do"
    if t.gradient_checkpointing:
        return "it asks for gradient checkpointing, which a group does not do"
    return None


def why_alone_now(request, status) -> str | None:
    """why_alone, or why a job (its JobStatus) trains alone since it left a group: its step ran out of memory."""
    return why_alone(request) or (status.train_alone or None)


DIR_KEY = "dir:"  # a base keyed by its directory: its node has not said its content digest yet


def group_key(request, shape: ModelShape | None) -> GroupKey:
    """What jobs of one group share: the base weights (the content digest where the node advertised it: until its
    agent has hashed the base, the directory, which on one node is the same files; the group's process checks the
    digests whichever it was), precision and quantisation; and the rule by which they yield to a serving engine,
    which the scheduler derives from the priority (an admin's job above --engine-yield exempt=P does not yield, a
    tenant's always does: the agent holds each member by its own rule, and jobs of unequal priority are never
    grouped); and the process the group runs (sessions, or training jobs)."""
    weights = shape.digest if shape is not None and shape.digest else DIR_KEY + request.base_dir.rstrip("/")
    return (weights, request.train.precision, request.quantization, request.priority, group_process(request))


def group_process(request) -> str:
    """Which process a group of this job runs: sessions (trainer/session/group.py) or training jobs (trainer/
    co_train); the two never share one."""
    return SESSION if request.train.method == SESSION else "train"


def founds_alone(request) -> bool:
    """Whether the job starts a group even with nobody queued to share it (a session: see the module's doc)."""
    return request.train.method == SESSION and why_alone(request) is None


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


__all__ = [
    "CO_TRAIN_POLICIES",
    "CoTrainPolicy",
    "GroupEstimate",
    "GroupKey",
    "METHODS",
    "SESSION",
    "founds_alone",
    "group_process",
    "group_estimate",
    "group_key",
    "own_mib",
    "shared_mib",
    "why_alone",
    "why_alone_now",
]
