"""Where graders run: the judge engine model graders call, whether python graders may run, the sandbox's limits."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Literal

PythonGraders = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class GraderContext:
    """What the operator allows here. `python_graders`: "auto" runs them only where the sandbox isolates fully
    (services/graders/sandbox.py), "on" also where it cannot, on a node that serves one tenant (`single_tenant`: the
    operator accepts what is missing), "off" never.
    The limits hold per sample (cpu_s, wall_s), per sandbox (memory_mib, max_processes and cpus for all of its
    processes together; memory_mib also for each one) or, where a caller asks for it (the gateway's graders
    endpoints), per request (request_sandbox_s)."""

    judge_url: str | None = None  # an OpenAI-compatible engine (…/v1/chat/completions); None: model graders refused
    judge_api_key: str | None = None
    judge_timeout_s: float = 60.0
    judge_concurrency: int = 8
    judge_image_hosts: tuple[str, ...] = ()  # hosts the judge engine may fetch input_image URLs from; else data: only
    python_graders: PythonGraders = "auto"
    cpu_s: float = 10.0
    wall_s: float = 20.0
    memory_mib: int = 512
    max_processes: int = 8
    cpus: float = 1.0  # the CPU time a sandbox's processes together get per wall-clock second (its cgroup's quota)
    request_sandbox_s: float = 60.0  # the most sandbox time one request's python graders may take, load and run
    tenant_calls: int = 4  # grader calls (validate, run) one tenant has running at a time on one gateway
    tenant_waiting: int = 16  # and waiting their turn; more are refused (429)
    scratch_dir: str | None = None  # where each sandbox gets a fresh directory; None: the system's temp dir
    single_tenant: bool = False  # the operator says this node serves one tenant: only then may "on" run unisolated
    command: str = "jetlora gateway"  # whose flags set this context: refusals name them

    def scratch(self) -> str:
        return self.scratch_dir or tempfile.gettempdir()
