"""Service commands: up, scheduler, agent, artifacts, dashboard; each runs until SIGTERM, or exits 1 saying why."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import socket
import sys
from pathlib import Path

from services.bus import BusOptions
from services.cli import args as args_
from services.cli.client import EXIT_FAILED, EXIT_OK
from services.runtime import StartupError, embedded_if_needed, serve

log = logging.getLogger(__name__)


def _scheduler_config(args):
    from services.scheduler.core import TenantQuota
    from services.scheduler.service import SchedulerConfig

    try:
        quotas = {tenant: TenantQuota.parse(limits) for tenant, _, limits in (q.partition("=") for q in args.quota)}
        default = TenantQuota.parse(args.default_quota)
    except ValueError as e:
        raise StartupError(f"--quota/--default-quota: {e}") from None
    return SchedulerConfig(
        heartbeat_interval=args.heartbeat_interval,
        misses=args.misses,
        quotas=quotas,
        default_quota=default,
        reclaim_pause_priority=args.reclaim_pause_priority,
        retention_s=args.retention_days * 86400,
        retention_artifacts=args.retention_artifacts,
        finished_in_memory_s=args.finished_in_memory_s,
        idempotency_window_s=args.idempotency_hours * 3600,
    )


def _agent_config(args):
    from services.agent.service import AgentConfig
    from services.embedded import state_dir

    cfg = AgentConfig(
        node=args.node,
        work_dir=Path(args.work_dir or state_dir() / "agent" / args.node).resolve(),
        heartbeat_interval=args.heartbeat_interval,
        offer_cpu=args.offer_cpu,
        simulate_gpus=args.simulate_gpus,
        dataset_cache_mib=args.dataset_cache_mib,
        engines=_engines(args),
        models=args.model,
        engine_yield=_yields(args),
        engine_check_interval=args.engine_check_interval,
        stage_adapters=not args.no_staging,
    )
    if args.trainer_command:
        cfg.trainer_command = shlex.split(args.trainer_command)
    return cfg


def _engines(args) -> list:
    from services.agent.engines import Engine

    models = args.engine_model
    if args.engine and len(models) not in (1, len(args.engine)):
        raise StartupError(
            f"{len(args.engine)} --engine but {len(models)} --engine-model: give one model for all, "
            "or one per engine in the same order"
        )
    try:
        return [
            Engine.parse(spec, models[0] if len(models) == 1 else models[i], args.engine_max_rank, args.engine_restart)
            for i, spec in enumerate(args.engine)
        ]
    except ValueError as e:
        raise StartupError(str(e)) from None


def _yields(args) -> list:
    from services.agent.yielding import YieldPolicy

    try:
        return [YieldPolicy.parse(text) for text in args.engine_yield]
    except ValueError as e:
        raise StartupError(str(e)) from None


async def run_scheduler(nc, stop, args) -> None:
    """The scheduler, and beside it the adapter registry's endpoints."""
    from services.registry.service import RegistryService
    from services.scheduler.service import Scheduler

    async with asyncio.TaskGroup() as tg:
        tg.create_task(Scheduler(nc, _scheduler_config(args)).run(stop))
        tg.create_task(RegistryService(nc).run(stop))


async def run_agent(nc, stop, args) -> None:
    from services.agent.service import Agent

    await Agent(nc, _agent_config(args)).run(stop)


async def run_artifacts(nc, stop, args) -> None:
    from schemas.datasets import DatasetLimits
    from services.artifacts.service import ArtifactService

    limits = DatasetLimits(
        max_bytes=args.dataset_max_mib * 2**20,
        max_rows=args.dataset_max_rows,
        max_row_bytes=args.dataset_max_row_kib * 1024,
    )
    await ArtifactService(nc, dataset_limits=limits).run(stop)


async def run_dashboard(nc, stop, args) -> None:
    from services.dashboard.server import Dashboard

    if not args.ws_url:
        raise StartupError(
            "the dashboard needs NATS's websocket URL: --ws ws://HOST:PORT (env NATS_WS_URL); "
            "deploy/nats-server.conf shows how to enable the websocket listener"
        )
    dash = Dashboard(nc, args.ws_url, port=args.port)
    await dash.start()
    print(f"dashboard: http://127.0.0.1:{dash.port}/", flush=True)
    await dash.run(stop)


async def run_all(nc, stop, args) -> None:
    """`jetlora up`: scheduler, artifact service, one local agent and the dashboard, on one loop; the dashboard's
    port is bound first, so a taken port stops `up` before anything else starts."""
    from services.dashboard.server import Dashboard

    dash = None
    if args.ws_url:
        dash = Dashboard(nc, args.ws_url, port=args.port)
        await dash.start()
        print(f"dashboard: http://127.0.0.1:{dash.port}/", flush=True)
    gateway = await _gateway(nc, args) if args.gateway_port is not None else None
    async with asyncio.TaskGroup() as tg:
        tg.create_task(run_scheduler(nc, stop, args))
        tg.create_task(run_artifacts(nc, stop, args))
        tg.create_task(run_agent(nc, stop, args))
        if dash:
            tg.create_task(dash.run(stop))
        if gateway:
            tg.create_task(gateway.run(stop))


async def _gateway(nc, args):
    """`up --gateway-port`: the OpenAI-compatible API beside the rest, its port bound before anything starts."""
    from services.bus import ensure_resources
    from services.cli.gateway import base_models
    from services.gateway.app import Gateway

    await ensure_resources(nc)  # its buckets: `up` owns the resources, but the scheduler makes them a moment later
    gateway = Gateway(
        nc, base_models(args.base_model, args.gateway_accelerator, "vllm", args.save_steps), port=args.gateway_port
    )
    try:
        await gateway.start()
    except OSError as e:
        raise StartupError(
            f"the gateway cannot listen on port {args.gateway_port} ({e.strerror}); choose another with --gateway-port"
        ) from None
    print(f"gateway: http://127.0.0.1:{gateway.port}/v1", flush=True)
    return gateway


def run_service(args, body, owns_resources: bool = True) -> int:
    """Start the embedded nats-server when no URL is given, run body(nc, stop, args) until a signal; a service
    that cannot start says why and exits 1, and everything it started is stopped."""
    opts = BusOptions.from_args(args, name=f"jetlora-{args.command}")
    server = embedded_if_needed(opts)
    if server:
        print(f"NATS at {server.url} (websocket {server.ws_url}); other commands: --nats {server.url}", flush=True)
        if hasattr(args, "ws_url") and not args.ws_url:
            args.ws_url = server.ws_url
    try:
        asyncio.run(
            serve(
                opts,
                lambda nc, stop: body(nc, stop, args),
                owns_resources or server is not None,
                shutdown_timeout=getattr(args, "shutdown_timeout", 15.0),
            )
        )
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as error:
        for e in _leaves(error):
            if not isinstance(e, StartupError):
                log.error("jetlora %s stopped on an error", args.command, exc_info=e)
            print(
                f"error: {e}"
                if isinstance(e, StartupError)
                else f"error: jetlora {args.command} stopped: {type(e).__name__}: {e}",
                file=sys.stderr,
            )
        return EXIT_FAILED
    finally:
        if server:
            server.stop()


def _leaves(error: BaseException) -> list[BaseException]:
    """The errors inside (nested) exception groups, or the error itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]


def register(sub: args_.SubCommands) -> None:
    """up, scheduler, dashboard, agent (the artifact service is `artifacts` with no action: see cli/artifacts.py)."""
    p = args_.service(sub, "up", "embedded NATS + scheduler + artifact service + a local agent + the dashboard")
    agent_flags(p)
    args_.dataset_limits(p)
    scheduler_flags(p)
    dashboard_flags(p)
    p.add_argument("--gateway-port", type=int, help="serve the OpenAI-compatible API on this port too")
    p.add_argument(
        "--gateway-accelerator", choices=["gpu", "cpu", "any"], default="any", help="what the API's jobs train on"
    )
    p.add_argument(
        "--base-model",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a base model the API's jobs may name (repeat)",
    )
    p.add_argument("--save-steps", type=int, default=100, help="the API's jobs: a checkpoint every N steps")
    p.set_defaults(fn=lambda a: run_service(a, run_all))
    p = args_.service(sub, "scheduler", "run the scheduler")
    scheduler_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_scheduler))
    p = args_.service(sub, "dashboard", "serve the live dashboard page")
    dashboard_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_dashboard, owns_resources=False))
    p = args_.service(sub, "agent", "run a node agent")
    agent_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_agent, owns_resources=False))


def agent_flags(p: argparse.ArgumentParser) -> None:
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
        "--engine-yield",
        action="append",
        default=[],
        metavar="MODE[,KEY=VALUE...]",
        help="how training yields to each --engine (one: all): both|compute|memory|off, then poll=S, "
        "timeout=S, holdoff=S, kv=FRACTION, metrics=S, devices=0+1, exempt=PRIORITY, nice=N "
        "(default: both,poll=0.2,timeout=1,holdoff=2,kv=0.9,metrics=1,nice=5)",
    )
    p.add_argument(
        "--engine-check-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="how often the agent compares what each engine serves with the registry (and reloads what an "
        "engine lost, e.g. after it restarted)",
    )
    p.add_argument(
        "--no-staging",
        action="store_true",
        help="fetch a new version of a served adapter only when it is promoted (by default it is fetched "
        "as soon as it is registered, so the promotion itself has nothing to fetch)",
    )
    p.add_argument(
        "--engine-restart",
        default="",
        help="llama.cpp: a command that restarts llama-server with the placed adapters ($JETLORA_ADAPTER_PATH)",
    )
    p.add_argument(
        "--model",
        action="append",
        default=_env_list("JETLORA_MODELS", ":"),
        help="a base model directory on this node (repeat; or JETLORA_MODELS=DIR:DIR): its shape goes "
        "into heartbeats, so jobs with gpu_mib 0 are sized for it",
    )
    p.add_argument(
        "--dataset-cache-mib",
        type=int,
        default=20480,
        help="disk kept for datasets and their tokenized copies, least recently used evicted first",
    )


def _env_list(variable: str, separator: str) -> list[str]:
    return [item for item in os.environ.get(variable, "").split(separator) if item]


def scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--misses", type=int, default=3, help="heartbeats missed before a node counts as gone")
    p.add_argument(
        "--quota",
        action="append",
        default=[],
        metavar="TENANT=queued:N,devices:M",
        help="what one tenant may hold at once (repeat for each tenant)",
    )
    p.add_argument(
        "--default-quota",
        default="",
        metavar="queued:N,devices:M",
        help="the quota of tenants without their own --quota (default: none)",
    )
    p.add_argument(
        "--reclaim-pause-priority",
        type=int,
        default=0,
        help="jobs at or below this priority pause when their GPU's serving engine wants memory back",
    )
    p.add_argument(
        "--retention-days",
        type=float,
        default=30.0,
        help="finished jobs' records and events are removed this long after they end (0: kept forever)",
    )
    p.add_argument("--retention-artifacts", action="store_true", help="and their artifacts with them")
    p.add_argument(
        "--finished-in-memory-s",
        type=float,
        default=600.0,
        help="a finished job stays in the scheduler's memory this long; then it is read from the store",
    )
    p.add_argument(
        "--idempotency-hours",
        type=float,
        default=24.0,
        help="a submission's idempotency key returns its first job for this long",
    )


def dashboard_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ws",
        dest="ws_url",
        default=os.environ.get("NATS_WS_URL"),
        help="NATS websocket URL the page connects to (env NATS_WS_URL)",
    )
    p.add_argument("--port", type=int, default=8222, help="the dashboard's HTTP port on 127.0.0.1")
