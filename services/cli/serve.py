"""Service commands: up, scheduler, agent, artifacts, dashboard; each runs until SIGTERM, or exits 1 saying why."""

from __future__ import annotations

import asyncio

from services.cli import args as args_
from services.cli.gateway import base_models
from services.cli.grader_flags import grader_context, grader_flags
from services.cli.running import run_service
from services.cli.scheduler_flags import scheduler_config, scheduler_flags
from services.cli.service_flags import agent_config, agent_flags, dashboard_flags
from services.cli.tinker_flags import tinker_flags, tinker_settings
from services.runtime import StartupError


async def run_scheduler(nc, stop, args) -> None:
    """The scheduler, and beside it the adapter registry's endpoints and the evals service's (which grades runs of
    samples with the grader flags: `up` has the agent's)."""
    from services.evals.service import EvalsService
    from services.registry.service import RegistryService
    from services.scheduler.service import Scheduler

    async with asyncio.TaskGroup() as tg:
        tg.create_task(Scheduler(nc, scheduler_config(args)).run(stop))
        tg.create_task(RegistryService(nc).run(stop))
        tg.create_task(EvalsService(nc, grader_context(args, "jetlora scheduler")).run(stop))


async def run_agent(nc, stop, args) -> None:
    from services.agent.service import Agent

    await Agent(nc, agent_config(args)).run(stop)


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
    from services.gateway.app import Gateway

    await ensure_resources(nc)  # its buckets: `up` owns the resources, but the scheduler makes them a moment later
    models = base_models(args.base_model, args.gateway_accelerator, "vllm", args.save_steps)
    gateway = Gateway(
        nc, models, port=args.gateway_port, graders=grader_context(args), tinker_settings=tinker_settings(args)
    )  # the agent's grader flags
    try:
        await gateway.start()
    except OSError as e:
        raise StartupError(
            f"the gateway cannot listen on port {args.gateway_port} ({e.strerror}); choose another with --gateway-port"
        ) from None
    print(f"gateway: http://127.0.0.1:{gateway.port}/v1", flush=True)
    return gateway


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
    tinker_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_all))
    p = args_.service(sub, "scheduler", "run the scheduler")
    scheduler_flags(p)
    grader_flags(p, "in eval runs of samples made elsewhere (OpenAI's jsonl data source), graded by the evals service")
    p.set_defaults(fn=lambda a: run_service(a, run_scheduler))
    p = args_.service(sub, "dashboard", "serve the live dashboard page")
    dashboard_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_dashboard, owns_resources=False))
    p = args_.service(sub, "agent", "run a node agent")
    agent_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_agent, owns_resources=False))
