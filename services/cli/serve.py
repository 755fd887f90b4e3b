"""Service commands: up, scheduler, agent, artifacts, dashboard; each runs until SIGTERM, or exits 1 saying why."""

from __future__ import annotations

import asyncio
import logging
import shlex
import sys
from pathlib import Path

from services.bus import BusOptions
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
    return SchedulerConfig(heartbeat_interval=args.heartbeat_interval, misses=args.misses, quotas=quotas,
                           default_quota=default, reclaim_pause_priority=args.reclaim_pause_priority,
                           retention_s=args.retention_days * 86400, retention_artifacts=args.retention_artifacts,
                           finished_in_memory_s=args.finished_in_memory_s,
                           idempotency_window_s=args.idempotency_hours * 3600)


def _agent_config(args):
    from services.agent.service import AgentConfig
    from services.embedded import state_dir

    cfg = AgentConfig(node=args.node, work_dir=Path(args.work_dir or state_dir() / "agent" / args.node),
                      heartbeat_interval=args.heartbeat_interval, offer_cpu=args.offer_cpu,
                      simulate_gpus=args.simulate_gpus, dataset_cache_mib=args.dataset_cache_mib,
                      engines=_engines(args), models=args.model, engine_yield=_yields(args))
    if args.trainer_command:
        cfg.trainer_command = shlex.split(args.trainer_command)
    return cfg


def _engines(args) -> list:
    from services.agent.engines import Engine

    models = args.engine_model
    if args.engine and len(models) not in (1, len(args.engine)):
        raise StartupError(f"{len(args.engine)} --engine but {len(models)} --engine-model: give one model for all, "
                           "or one per engine in the same order")
    try:
        return [Engine.parse(spec, models[0] if len(models) == 1 else models[i], args.engine_max_rank, args.engine_restart)
                for i, spec in enumerate(args.engine)]
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

    limits = DatasetLimits(max_bytes=args.dataset_max_mib * 2**20, max_rows=args.dataset_max_rows,
                           max_row_bytes=args.dataset_max_row_kib * 1024)
    await ArtifactService(nc, dataset_limits=limits).run(stop)


async def run_dashboard(nc, stop, args) -> None:
    from services.dashboard.server import Dashboard

    if not args.ws_url:
        raise StartupError("the dashboard needs NATS's websocket URL: --ws ws://HOST:PORT (env NATS_WS_URL); "
                           "deploy/nats-server.conf shows how to enable the websocket listener")
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
    async with asyncio.TaskGroup() as tg:
        tg.create_task(run_scheduler(nc, stop, args))
        tg.create_task(run_artifacts(nc, stop, args))
        tg.create_task(run_agent(nc, stop, args))
        if dash:
            tg.create_task(dash.run(stop))


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
        asyncio.run(serve(opts, lambda nc, stop: body(nc, stop, args), owns_resources or server is not None,
                          shutdown_timeout=getattr(args, "shutdown_timeout", 15.0)))
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as error:
        for e in _leaves(error):
            if not isinstance(e, StartupError):
                log.error("jetlora %s stopped on an error", args.command, exc_info=e)
            print(f"error: {e}" if isinstance(e, StartupError) else
                  f"error: jetlora {args.command} stopped: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if server:
            server.stop()


def _leaves(error: BaseException) -> list[BaseException]:
    """The errors inside (nested) exception groups, or the error itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]
