"""The long-running services' flags, and the configs built from them (a flag's mistake is a StartupError)."""

from __future__ import annotations

import argparse
import os
import shlex
import socket
from pathlib import Path

from schemas.parity import PARITY_EPSILON, PARITY_FACTOR
from services.cli.grader_flags import grader_flags, trainer_env
from services.runtime import StartupError


def agent_config(args):
    from services.agent.config import AgentConfig
    from services.embedded import state_dir

    cfg = AgentConfig(
        node=args.node,
        work_dir=Path(args.work_dir or state_dir() / "agent" / args.node).resolve(),
        heartbeat_interval=args.heartbeat_interval,
        offer_cpu=args.offer_cpu,
        simulate_gpus=args.simulate_gpus,
        dataset_cache_mib=args.dataset_cache_mib,
        adapter_cache_mib=args.adapter_cache_mib,
        engines=_engines(args),
        models=args.model,
        engine_yield=_yields(args),
        engine_check_interval=args.engine_check_interval,
        rollout_priority=args.engine_rollout_priority,
        stage_adapters=not args.no_staging,
        trainer_lease_s=args.trainer_lease_s,
        grader_env=trainer_env(args),
    )
    if args.trainer_command:
        cfg.trainer_command = shlex.split(args.trainer_command)
    if args.group_command:
        cfg.group_command = shlex.split(args.group_command)
    return cfg


def _engines(args) -> list:
    from services.agent.engines import Engine

    models = args.engine_model
    if args.engine and len(models) not in (1, len(args.engine)):
        raise StartupError(
            f"{len(args.engine)} --engine but {len(models)} --engine-model: give one model for all, "
            "or one per engine in the same order"
        )
    caps = args.engine_max_adapters
    if args.engine and len(caps) not in (0, 1, len(args.engine)):
        raise StartupError(
            f"{len(args.engine)} --engine but {len(caps)} --engine-max-adapters: give one for all, "
            "or one per engine in the same order"
        )
    try:
        engines = [
            Engine.parse(spec, models[0] if len(models) == 1 else models[i], args.engine_max_rank, args.engine_restart)
            for i, spec in enumerate(args.engine)
        ]
    except ValueError as e:
        raise StartupError(str(e)) from None
    for i, engine in enumerate(engines):
        engine.max_adapters = (caps[0] if len(caps) == 1 else caps[i]) if caps else 0
        engine.parity_factor, engine.parity_epsilon = args.engine_parity_factor, args.engine_parity_epsilon
        if engine.max_adapters < 0:
            raise StartupError(f"--engine-max-adapters {engine.max_adapters}: write a count, or 0 for no cap")
    return engines


def _yields(args) -> list:
    from services.agent.yielding import YieldPolicy

    try:
        return [YieldPolicy.parse(text) for text in args.engine_yield]
    except ValueError as e:
        raise StartupError(str(e)) from None


def agent_flags(p: argparse.ArgumentParser) -> None:
    """`jetlora agent`'s flags (and `up`'s, which runs one)."""
    _node_flags(p)
    _engine_flags(p)
    _deployment_flags(p)
    _cache_flags(p)
    grader_flags(p, "in this node's grpo jobs (the trainer's environment)")


def _node_flags(p: argparse.ArgumentParser) -> None:
    """The agent's flags for the node: who it is, where it works, what it offers and how its trainers run."""
    p.add_argument("--node", default=os.environ.get("JETLORA_NODE", socket.gethostname().split(".")[0]))
    p.add_argument("--work-dir")
    p.add_argument("--offer-cpu", action="store_true", help="train on this node's CPU too (no GPU needed)")
    p.add_argument("--simulate-gpus", help="report simulated GPUs of these MiB, e.g. 24576,24576 (tests)")
    p.add_argument(
        "--trainer-command",
        help="the trainer to run (default: this Python's `-m trainer`); "
        "an engine's Python goes here, e.g. '/opt/vllm/bin/python -m trainer'",
    )
    p.add_argument(
        "--group-command",
        help="the co-training groups' trainer (default: this Python's `-m trainer.co_train`); a test's stand-in goes "
        "here",
    )
    p.add_argument(
        "--trainer-lease-s",
        type=float,
        default=None,
        help="a trainer stops before its next step once this long has passed since the node's last heartbeat "
        "reached NATS, and a job moved off a silent node waits this long (at most) before its next attempt trains "
        "(so a frozen or cut-off node never trains beside it); default two heartbeat intervals; 0: never",
    )
    p.add_argument(
        "--model",
        action="append",
        default=_env_list("JETLORA_MODELS", ":"),
        help="a base model directory on this node (repeat; or JETLORA_MODELS=DIR:DIR): its shape goes "
        "into heartbeats, so jobs with gpu_mib 0 are sized for it",
    )


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """The agent's flags for the serving engines beside it, which load the registry's adapters of their model."""
    p.add_argument(
        "--engine",
        action="append",
        default=_env_list("JETLORA_ENGINES", ";"),
        help="a serving engine here, which loads the registry's adapters of its model: vllm=URL, "
        "vllm-dir=DIR[,URL] (vLLM's filesystem resolver) or llamacpp=DIR[,URL] (repeat; env "
        "JETLORA_ENGINES, ';' between)",
    )
    p.add_argument(
        "--engine-model",
        action="append",
        default=_env_list("JETLORA_ENGINE_MODELS", ";"),
        help="the base model (catalog name) each --engine serves, in the same order (one: all)",
    )
    p.add_argument("--engine-max-rank", type=int, default=64, help="the largest LoRA rank the engines take")
    p.add_argument(
        "--engine-max-adapters",
        action="append",
        type=int,
        default=[],
        metavar="N",
        help="the most adapter names each vLLM --engine keeps loaded (one: all, or one per engine; 0: no cap): "
        "past it the least recently used are unloaded (vllm-dir: left placed, loaded again on demand) and "
        "reported so; keep it within vLLM's --max-cpu-loras",
    )
    p.add_argument(
        "--engine-rollout-priority",
        type=int,
        default=0,
        metavar="P",
        help="the priority grpo jobs' rollouts ask of a vLLM --engine started with --scheduling-policy priority "
        "(larger is served later; live requests ask 0 unless they say otherwise), e.g. 10; 0: the engine schedules "
        "first come, first served",
    )
    p.add_argument(
        "--engine-restart",
        default="",
        help="llama.cpp: a command that restarts llama-server with the placed adapters ($JETLORA_ADAPTER_PATH)",
    )


def _deployment_flags(p: argparse.ArgumentParser) -> None:
    """The agent's flags for how it keeps the engines on the registry, and how training yields to them."""
    p.add_argument(
        "--engine-check-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="how often the agent compares what each engine serves with the registry (and reloads what an "
        "engine lost, e.g. after it restarted)",
    )
    p.add_argument(
        "--engine-parity-factor",
        type=float,
        default=PARITY_FACTOR,
        metavar="F",
        help="train/serve parity: a version whose mean per-token |Δ log p| against its trainer's is above F x the "
        "same measured with the base model alone (the engine's noise floor) + --engine-parity-epsilon is reported "
        "mismatch (a canary on it rolls back)",
    )
    p.add_argument(
        "--engine-parity-epsilon",
        type=float,
        default=PARITY_EPSILON,
        metavar="NATS",
        help="what parity allows above F x the floor, where the floor is near 0 (an fp32 engine)",
    )
    p.add_argument(
        "--no-staging",
        action="store_true",
        help="fetch a new version of a served adapter only when it is promoted (by default it is fetched "
        "as soon as it is registered, so the promotion itself has nothing to fetch)",
    )
    p.add_argument(
        "--engine-yield",
        action="append",
        default=[],
        metavar="MODE[,KEY=VALUE...]",
        help="how training yields to each --engine (one: all): both|compute|memory|off, then poll=S, "
        "timeout=S, holdoff=S, kv=FRACTION, metrics=S, devices=0+1, exempt=PRIORITY (admins' jobs above it never "
        "yield; tenants' always do), nice=N, silent=S (a trainer stopped for an engine that has not answered this "
        "long goes on) "
        "(default: both,poll=0.2,timeout=1,holdoff=2,kv=0.9,metrics=1,nice=5,silent=60)",
    )


def _cache_flags(p: argparse.ArgumentParser) -> None:
    """The agent's flags for the disk it keeps for datasets and adapters."""
    p.add_argument(
        "--dataset-cache-mib",
        type=int,
        default=20480,
        help="disk kept for datasets and their tokenized copies, least recently used evicted first",
    )
    p.add_argument(
        "--adapter-cache-mib",
        type=int,
        default=10240,
        help="disk kept for fetched adapters, least recently used removed first; what an engine serves always stays",
    )


def _env_list(variable: str, separator: str) -> list[str]:
    return [item for item in os.environ.get(variable, "").split(separator) if item]


def dashboard_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ws",
        dest="ws_url",
        default=os.environ.get("NATS_WS_URL"),
        help="NATS websocket URL the page connects to (env NATS_WS_URL)",
    )
    p.add_argument("--port", type=int, default=8222, help="the dashboard's HTTP port on 127.0.0.1")
