"""OpenAI's graders, checked and run: shared plumbing the gateway and the trainer both import (no torch, no
service). Python graders run in a sandbox process (sandbox.py), never in the caller's. The async forms
(check_async, grade_many_async) are for callers on an event loop: cancelling them kills what they started."""

from services.graders.check import check, check_async
from services.graders.context import GraderContext
from services.graders.deadline import Deadline
from services.graders.grade import grade_many, grade_many_async
from services.graders.sandbox import SandboxStatus, status

__all__ = [
    "Deadline",
    "GraderContext",
    "SandboxStatus",
    "check",
    "check_async",
    "grade_many",
    "grade_many_async",
    "status",
]
