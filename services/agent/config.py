"""What a node's agent is told at start (the flags of `jetlora agent`: services/cli/service_flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.agent.engines import Engine
from services.agent.deployment import CHECK_INTERVAL_S
from services.agent.group_run import DEFAULT_GROUP_TRAINER
from services.agent.runner import DEFAULT_TRAINER
from services.agent.yielding import YieldPolicy


@dataclass
class AgentConfig:
    """A node agent's settings: who it is, where it works, what it offers and serves, how often it speaks."""

    node: str
    work_dir: Path
    heartbeat_interval: float = 1.0
    offer_cpu: bool = False
    simulate_gpus: str | None = None
    trainer_command: list[str] = field(default_factory=lambda: list(DEFAULT_TRAINER))
    group_command: list[str] = field(default_factory=lambda: list(DEFAULT_GROUP_TRAINER))  # co-training groups'
    keep_job_dirs: bool = False
    dataset_cache_mib: int = 20480  # datasets (and their tokenized copies) kept for the next job
    adapter_cache_mib: int = 10240  # fetched adapters kept (what engines serve stays even over it)
    engines: list[Engine] = field(default_factory=list)  # serving engines here: they load the registry's adapters
    models: list[str] = field(default_factory=list)  # base model directories here, advertised with their shapes
    engine_yield: list[YieldPolicy] = field(default_factory=list)  # per engine (one: for all); none: YieldPolicy()
    engine_check_interval: float = CHECK_INTERVAL_S  # how often what each engine serves is compared with the registry
    rollout_priority: int = 0  # grpo rollouts' priority at a vLLM that schedules by priority (larger: later); 0: none
    grader_env: dict[str, str] = field(default_factory=dict)  # the trainers' graders settings (JETLORA_JUDGE_URL...)
    stage_adapters: bool = True  # fetch a new version of a served adapter when it is registered, before its promotion
    trainer_lease_s: float | None = None  # a trainer computes this long after the node's last heartbeat reached
    # the bus, and another node's attempt of its job waits this long for it (services/agent/trainer_leases.py);
    # None: two heartbeat intervals (below the scheduler's window, so a job moved off a silent node seldom waits);
    # 0: never waits (and the job's attempt on another node does not wait for it either)

    @property
    def lease_s(self) -> float:
        return 2 * self.heartbeat_interval if self.trainer_lease_s is None else self.trainer_lease_s
