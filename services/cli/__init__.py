"""`jetlora`: run the services, submit and watch jobs, fetch artifacts. A thin client of the NATS endpoints."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import sys
from pathlib import Path

import msgspec

from schemas import names
from schemas.artifacts import ArtifactList, ArtifactQuery, Deleted
from schemas.jobs import Accepted, Error, JobList, JobListQuery, JobQuery, JobReply, JobRequest, SubmitReply
from schemas.nodes import NodeList
from services import bus
from services.bus import BusOptions
from services.runtime import embedded_if_needed, serve, setup_logging

EXIT_OK, EXIT_FAILED, EXIT_REJECTED, EXIT_UNREACHABLE = 0, 1, 2, 3


# --- services -------------------------------------------------------------------------------------
def _scheduler_config(args):
    from services.scheduler.service import SchedulerConfig

    return SchedulerConfig(heartbeat_interval=args.heartbeat_interval, misses=args.misses)


def _agent_config(args):
    from services.agent.service import AgentConfig
    from services.embedded import state_dir

    cfg = AgentConfig(node=args.node, work_dir=Path(args.work_dir or state_dir() / "agent" / args.node),
                      heartbeat_interval=args.heartbeat_interval, offer_cpu=args.offer_cpu,
                      simulate_gpus=args.simulate_gpus)
    if args.trainer_command:
        cfg.trainer_command = shlex.split(args.trainer_command)
    return cfg


async def _run_scheduler(nc, stop, args) -> None:
    from services.scheduler.service import Scheduler

    await Scheduler(nc, _scheduler_config(args)).run(stop)


async def _run_agent(nc, stop, args) -> None:
    from services.agent.service import Agent

    await Agent(nc, _agent_config(args)).run(stop)


async def _run_artifacts(nc, stop, args) -> None:
    from services.artifacts.service import ArtifactService

    await ArtifactService(nc).run(stop)


async def _run_dashboard(nc, stop, args) -> None:
    from services.dashboard.server import Dashboard

    if not args.ws_url:
        raise SystemExit("the dashboard needs NATS's websocket URL: --ws ws://HOST:PORT (env NATS_WS_URL); "
                         "deploy/nats-server.conf shows how to enable the websocket listener")
    dash = Dashboard(nc, args.ws_url, port=args.port)
    task = asyncio.create_task(dash.run(stop))
    await dash.ready.wait()
    print(f"dashboard: http://127.0.0.1:{dash.port}/", flush=True)
    await task


async def _run_all(nc, stop, args) -> None:
    """`jetlora up`: scheduler, artifact service, one local agent and the dashboard, on one loop."""
    async with asyncio.TaskGroup() as tg:
        tg.create_task(_run_scheduler(nc, stop, args))
        tg.create_task(_run_artifacts(nc, stop, args))
        tg.create_task(_run_agent(nc, stop, args))
        if args.ws_url:
            tg.create_task(_run_dashboard(nc, stop, args))


def run_service(args, body, owns_resources: bool = True) -> int:
    opts = BusOptions.from_args(args, name=f"jetlora-{args.command}")
    server = embedded_if_needed(opts)
    if server:
        print(f"NATS at {server.url} (websocket {server.ws_url}); other commands: --nats {server.url}", flush=True)
        if hasattr(args, "ws_url") and not args.ws_url:
            args.ws_url = server.ws_url
    try:
        asyncio.run(serve(opts, lambda nc, stop: body(nc, stop, args), owns_resources or server is not None))
    except KeyboardInterrupt:
        pass
    finally:
        if server:
            server.stop()
    return EXIT_OK


# --- clients --------------------------------------------------------------------------------------
def _client(args, coro_fn):
    opts = BusOptions.from_args(args, name="jetlora-cli")
    if not opts.url:
        print("give --nats URL (or NATS_URL) of the server that `jetlora up` printed", file=sys.stderr)
        return EXIT_UNREACHABLE

    async def go():
        try:
            nc = await bus.connect(opts, service=False)
        except Exception as e:  # nats-py raises NoServersError, OSError or TimeoutError here
            raise OSError(f"{type(e).__name__} {e}".strip()) from None
        try:
            return await coro_fn(nc)
        finally:
            await nc.drain()

    try:
        return asyncio.run(go())
    except bus.RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except OSError as e:
        print(f"error: cannot reach NATS at {opts.url}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE


def _load_job_file(path: str) -> bytes:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        return json.dumps(yaml.safe_load(text)).encode()
    return text.encode()


def _print(obj, as_json: bool, table) -> None:
    if as_json:
        sys.stdout.write(msgspec.json.encode(obj).decode() + "\n")
    else:
        table(obj)


def cmd_submit(args) -> int:
    payload = _load_job_file(args.job_file)

    async def go(nc):
        reply = await bus.request(nc, names.SUBMIT, payload, SubmitReply, timeout=args.timeout)
        if isinstance(reply, Accepted):
            print(reply.job if not args.json else msgspec.json.encode(reply).decode())
            return EXIT_OK
        if args.json:
            print(msgspec.json.encode(reply).decode())
        else:
            for e in reply.errors:
                print(f"rejected: {e.field or '(request)'}: {e.reason}", file=sys.stderr)
        return EXIT_REJECTED

    return _client(args, go)


def cmd_jobs(args) -> int:
    async def go(nc):
        reply = await bus.request(nc, names.LIST_JOBS, JobListQuery(state=args.state, node=args.node), JobList | Error)
        if isinstance(reply, Error):
            print(f"error: {reply.error}", file=sys.stderr)
            return EXIT_FAILED
        _print(reply, args.json, _jobs_table)
        return EXIT_OK

    return _client(args, go)


def _jobs_table(reply: JobList) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("job", "state", "node", "dev", "step", "loss", "label", "message")
    for j in reply.jobs:
        t.add_row(j.id, j.state, j.node or "", "" if j.device is None else str(j.device), f"{j.step}/{j.steps}",
                  "" if j.loss is None else f"{j.loss:.4f}", j.label, j.message[:80])
    Console().print(t)


def cmd_job(args) -> int:
    async def go(nc):
        reply = await bus.request(nc, names.GET_JOB, JobQuery(args.job), JobReply | Error)
        if isinstance(reply, Error):
            print(f"error: {reply.error}", file=sys.stderr)
            return EXIT_FAILED
        print(msgspec.json.format(msgspec.json.encode(reply.job)).decode())
        return EXIT_OK

    return _client(args, go)


def cmd_nodes(args) -> int:
    async def go(nc):
        reply = await bus.request(nc, names.LIST_NODES, b"{}", NodeList)
        _print(reply, args.json, _nodes_table)
        return EXIT_OK

    return _client(args, go)


def _nodes_table(reply: NodeList) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("node", "alive", "device", "free / total MiB", "jobs", "note")
    for n in reply.nodes:
        for d in n.devices or [None]:
            t.add_row(n.node, "yes" if n.alive else "no", "" if d is None else f"{d.index} {d.name}",
                      "" if d is None else f"{d.free_mib} / {d.total_mib}", "" if d is None else ",".join(d.jobs),
                      n.no_gpu_reason)
    Console().print(t)


def cmd_control(args) -> int:
    subject = names.CANCEL if args.command == "cancel" else names.STOP

    async def go(nc):
        reply = await bus.request(nc, subject, JobQuery(args.job), JobReply | Error)
        if isinstance(reply, Error):
            print(f"error: {reply.error}", file=sys.stderr)
            return EXIT_FAILED
        print(f"{args.command} asked of job {args.job}: {reply.job.state}")
        return EXIT_OK

    return _client(args, go)


def cmd_watch(args) -> int:
    from services.watch import watch

    return _client(args, lambda nc: watch(nc, args.job, as_json=args.json))


def cmd_artifacts(args) -> int:
    if args.action is None:
        return run_service(args, _run_artifacts)

    async def go(nc):
        if args.action == "ls":
            reply = await bus.request(nc, names.ARTIFACTS_LIST, ArtifactQuery(job=args.job), ArtifactList | Error)
            if isinstance(reply, Error):
                print(f"error: {reply.error}", file=sys.stderr)
                return EXIT_FAILED
            _print(reply, args.json, lambda r: [print(f"{a.name}\t{a.size}\t{a.sha256[:16]}\t{a.created}") for a in r.artifacts])
            return EXIT_OK
        if args.action == "rm":
            reply = await bus.request(nc, names.ARTIFACTS_DELETE, ArtifactQuery(job=args.job, kind=args.kind), Deleted | Error)
            if isinstance(reply, Error):
                print(f"error: {reply.error}", file=sys.stderr)
                return EXIT_FAILED
            print("\n".join(reply.names) or "nothing to delete")
            return EXIT_OK
        from services.artifacts.download import DownloadError, download

        try:
            info = await download(nc, args.job, args.kind, args.output)
        except DownloadError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_FAILED
        print(f"{args.output}\t{info.size} bytes\tsha256 {info.sha256} verified")
        return EXIT_OK

    return _client(args, go)


def cmd_permissions(args) -> int:
    from schemas.permissions import authorization_block, env_var, roles

    nodes = [n for n in args.nodes.split(",") if n]
    block = authorization_block(nodes)
    if args.out:
        Path(args.out).write_text(block)
        print(f"wrote {args.out}; give nats-server these variables: "
              + " ".join(env_var(u) for u in roles(nodes)), file=sys.stderr)
    else:
        sys.stdout.write(block)
    return EXIT_OK


def cmd_schema(args) -> int:
    from schemas.export import write_all

    for path in write_all(Path(args.out) if args.out else None):
        print(path)
    return EXIT_OK


def cmd_demo(args) -> int:
    from services.demo import run_demo

    try:
        return asyncio.run(run_demo(Path(args.out), args.steps, args.keep))
    except KeyboardInterrupt:
        return EXIT_OK


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jetlora", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    def service(name, help_):
        p = sub.add_parser(name, help=help_)
        BusOptions.add_arguments(p)
        p.add_argument("--heartbeat-interval", type=float, default=1.0)
        return p

    def agent_flags(p):
        p.add_argument("--node", default=os.environ.get("JETLORA_NODE", socket.gethostname().split(".")[0]))
        p.add_argument("--work-dir")
        p.add_argument("--offer-cpu", action="store_true", help="train on this node's CPU too (no GPU needed)")
        p.add_argument("--simulate-gpus", help="report simulated GPUs of these MiB, e.g. 24576,24576 (tests)")
        p.add_argument("--trainer-command", help="the trainer to run (default: this Python's `-m trainer`); "
                                                  "an engine's Python goes here, e.g. '/opt/vllm/bin/python -m trainer'")

    def sched_flags(p):
        p.add_argument("--misses", type=int, default=3, help="heartbeats missed before a node counts as gone")

    def dashboard_flags(p):
        p.add_argument("--ws", dest="ws_url", default=os.environ.get("NATS_WS_URL"),
                       help="NATS websocket URL the page connects to (env NATS_WS_URL)")
        p.add_argument("--port", type=int, default=8222, help="the dashboard's HTTP port on 127.0.0.1")

    p = service("up", "embedded NATS + scheduler + artifact service + a local agent + the dashboard")
    agent_flags(p)
    sched_flags(p)
    dashboard_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, _run_all))
    p = service("scheduler", "run the scheduler")
    sched_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, _run_scheduler))
    p = service("dashboard", "serve the live dashboard page")
    dashboard_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, _run_dashboard, owns_resources=False))
    p = service("agent", "run a node agent")
    agent_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, _run_agent, owns_resources=False))

    def client(name, help_):
        p = sub.add_parser(name, help=help_)
        BusOptions.add_arguments(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--timeout", type=float, default=bus.DEFAULT_TIMEOUT)
        return p

    p = client("submit", "submit a job (JSON or YAML file)")
    p.add_argument("job_file")
    p.set_defaults(fn=cmd_submit)
    p = client("jobs", "list jobs")
    p.add_argument("--state")
    p.add_argument("--node")
    p.set_defaults(fn=cmd_jobs)
    p = client("job", "show one job")
    p.add_argument("job")
    p.set_defaults(fn=cmd_job)
    p = client("nodes", "list nodes and their devices")
    p.set_defaults(fn=cmd_nodes)
    for name, help_ in (("cancel", "cancel a job (kill its trainer)"), ("stop", "stop a job and keep what it learnt")):
        p = client(name, help_)
        p.add_argument("job")
        p.set_defaults(fn=cmd_control)
    p = client("watch", "follow a job's progress (replayed from its start)")
    p.add_argument("job")
    p.set_defaults(fn=cmd_watch)
    p = client("artifacts", "run the artifact service, or: ls / get / rm")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help=argparse.SUPPRESS)
    asub = p.add_subparsers(dest="action")

    def action(name, help_):
        a = asub.add_parser(name, help=help_)
        BusOptions.add_arguments(a, repeated=True)
        a.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        return a

    a = action("ls", "list artifacts")
    a.add_argument("--job")
    a = action("get", "download one, sha256 checked")
    a.add_argument("job")
    a.add_argument("kind", choices=["peft", "gguf", "checkpoint"])
    a.add_argument("-o", "--output", required=True)
    a = action("rm", "delete a job's artifacts")
    a.add_argument("job")
    a.add_argument("--kind", choices=["peft", "gguf", "checkpoint"])
    p.set_defaults(fn=cmd_artifacts)
    p = sub.add_parser("demo", help="train a LoRA on a small local model end to end, on this machine")
    p.add_argument("--out", default="demo-out", help="where the model and the downloaded artifacts go")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--keep", action="store_true", help="keep the stack and the dashboard up after the run")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("permissions", help="write the per-role users and subject permissions for nats-server")
    p.add_argument("--nodes", default="", help="agent node ids, comma separated: one user each")
    p.add_argument("--out")
    p.set_defaults(fn=cmd_permissions)
    p = sub.add_parser("schema", help="write the JSON Schemas and the AsyncAPI document into schemas/")
    p.add_argument("--out")
    p.set_defaults(fn=cmd_schema)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.verbose)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
