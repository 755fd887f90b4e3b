"""OpenAI's graders, checked and run: shared plumbing the gateway and the trainer both import (no torch, no
service). Python graders run in a sandbox process (sandbox.py), never in the caller's."""

from services.graders.check import check
from services.graders.context import GraderContext
from services.graders.grade import grade_many
from services.graders.sandbox import SandboxStatus, status

__all__ = ["GraderContext", "SandboxStatus", "check", "grade_many", "status"]
