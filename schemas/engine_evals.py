"""Eval runs through a node's engine: `jetlora evals run EVAL --model NAME[@V]` where an engine serves that version
under NAME samples through it (what users get), not through the trainer. The evals service asks one node's agent
(names.node(node).evaluate, request/reply): answer the run's items (the eval's rft dataset, pinned by sha256) through
the engine's chat completions under the served name, grade them with the eval's graders there (python graders in the
node's sandbox), and reply with the per-item results; the evals service stores them, with their summary, as a
trainer-side run's `eval` artifact is stored (schemas/evals.py), so gates, `adapters show` and OpenAI's output_items
read them alike. The run's record says which path produced it (`EvalRun.via`)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from schemas.evals import Criterion, ItemResult, Sampling, Token
from schemas.jobs import DatasetRef, NodeId
from schemas.served import REQUEST_TIMEOUT_S

TRAINER = "trainer"  # EvalRun.via of a run sampled by the trainer (an engine's: "engine <label> on <node>")
DEADLINE_S = 600.0  # a node's budget for the whole run, on its own clock
REPLY_SLACK_S = 15.0  # the evals service waits this much longer than the node's deadline for its reply


class EngineEvalRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """The evals service -> a node's agent: answer the run's items through an engine of this node that serves
    `adapter`@`version` under `adapter` (`engine`, the one the registry says loaded it, first), and grade them."""

    run: Token
    eval: Token
    adapter: NodeId
    version: Annotated[int, Meta(ge=1)]
    engine: str = ""
    dataset: DatasetRef  # the items: the eval's rft dataset, its name, owner and sha256 pinned
    criteria: Annotated[list[Criterion], Meta(min_length=1, max_length=16)]
    sampling: Sampling
    deadline_s: Annotated[float, Meta(gt=0)] = DEADLINE_S
    request_timeout_s: Annotated[float, Meta(gt=0)] = REQUEST_TIMEOUT_S  # one completion


class EngineEvalReply(Struct, tag="engine_eval", tag_field="type", kw_only=True):
    """The node's answer: every item's completions and scores, as the trainer's ItemResult lines hold them."""

    node: str
    engine: str  # the engine's label
    items: list[ItemResult]
    seconds: float = 0.0


def engine_via(engine: str, node: str) -> str:
    """EvalRun.via of a run sampled by that engine on that node."""
    return f"engine {engine} on {node}"
