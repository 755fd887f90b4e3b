"""`jetlora`: run the services, submit and watch jobs, fetch artifacts. A thin client of the NATS endpoints."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path

from services import bus
from services.bus import BusOptions
from services.cli.adapters import cmd_adapters
from services.cli.artifacts import cmd_artifacts
from services.cli.client import EXIT_OK, EXIT_REJECTED
from services.cli.datasets import cmd_datasets
from services.cli.estimate import cmd_estimate
from services.cli.jobs import (cmd_checkpoints, cmd_control, cmd_events, cmd_job, cmd_jobs, cmd_nodes, cmd_submit,
                               cmd_watch, cmd_why)
from services.cli.serve import run_agent, run_all, run_artifacts, run_dashboard, run_scheduler, run_service
from services.runtime import setup_logging


def cmd_permissions(args) -> int:
    from services.cli.permissions import authorization_block, env_var, roles

    nodes = [n for n in args.nodes.split(",") if n]
    tenants = [t for t in args.tenants.split(",") if t]
    try:
        block = authorization_block(nodes, tenants)
    except ValueError as e:  # a node or tenant that cannot be a subject token (or is reserved)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REJECTED
    if args.out:
        Path(args.out).write_text(block)
        print(f"wrote {args.out}; give nats-server these variables: "
              + " ".join(env_var(u) for u in roles(nodes, tenants)), file=sys.stderr)
    else:
        sys.stdout.write(block)
    return EXIT_OK


def cmd_schema(args) -> int:
    from schemas.export import write_all

    for path in write_all(Path(args.out) if args.out else None):
        print(path)
    return EXIT_OK


def cmd_demo(args) -> int:
    from services.cli.demo import run_demo

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
        p.add_argument("--shutdown-timeout", type=float, default=15.0, metavar="S",
                       help="on SIGINT/SIGTERM, what is left after this many seconds is ended and the exit is 1")
        return p

    def agent_flags(p):
        p.add_argument("--node", default=os.environ.get("JETLORA_NODE", socket.gethostname().split(".")[0]))
        p.add_argument("--work-dir")
        p.add_argument("--offer-cpu", action="store_true", help="train on this node's CPU too (no GPU needed)")
        p.add_argument("--simulate-gpus", help="report simulated GPUs of these MiB, e.g. 24576,24576 (tests)")
        p.add_argument("--trainer-command", help="the trainer to run (default: this Python's `-m trainer`); "
                                                  "an engine's Python goes here, e.g. '/opt/vllm/bin/python -m trainer'")
        p.add_argument("--engine", action="append", default=[e for e in os.environ.get("JETLORA_ENGINES", "").split(";") if e],
                       help="a serving engine here, which loads the registry's adapters of its model: vllm=URL, "
                            "vllm-dir=DIR[,URL] (vLLM's filesystem resolver) or llamacpp=DIR[,URL] (repeat; env "
                            "JETLORA_ENGINES, ';' between)")
        p.add_argument("--engine-model", action="append", default=[m for m in os.environ.get("JETLORA_ENGINE_MODELS", "").split(";") if m],
                       help="the base model (catalog name) each --engine serves, in the same order (one: all)")
        p.add_argument("--engine-max-rank", type=int, default=64, help="the largest LoRA rank the engines take")
        p.add_argument("--engine-yield", action="append", default=[], metavar="MODE[,KEY=VALUE...]",
                       help="how training yields to each --engine (one: all): both|compute|memory|off, then poll=S, "
                            "timeout=S, holdoff=S, kv=FRACTION, devices=0+1, exempt=PRIORITY "
                            "(default: both,poll=0.2,timeout=1,holdoff=2,kv=0.9)")
        p.add_argument("--engine-restart", default="", help="llama.cpp: a command that restarts llama-server with the "
                                                            "placed adapters ($JETLORA_ADAPTER_PATH)")
        p.add_argument("--model", action="append", default=[m for m in os.environ.get("JETLORA_MODELS", "").split(":") if m],
                       help="a base model directory on this node (repeat; or JETLORA_MODELS=DIR:DIR): its shape goes "
                            "into heartbeats, so jobs with gpu_mib 0 are sized for it")
        p.add_argument("--dataset-cache-mib", type=int, default=20480,
                       help="disk kept for datasets and their tokenized copies, least recently used evicted first")

    def sched_flags(p):
        p.add_argument("--misses", type=int, default=3, help="heartbeats missed before a node counts as gone")
        p.add_argument("--quota", action="append", default=[], metavar="TENANT=queued:N,devices:M",
                       help="what one tenant may hold at once (repeat for each tenant)")
        p.add_argument("--default-quota", default="", metavar="queued:N,devices:M",
                       help="the quota of tenants without their own --quota (default: none)")
        p.add_argument("--reclaim-pause-priority", type=int, default=0,
                       help="jobs at or below this priority pause when their GPU's serving engine wants memory back")
        p.add_argument("--retention-days", type=float, default=30.0,
                       help="finished jobs' records and events are removed this long after they end (0: kept forever)")
        p.add_argument("--retention-artifacts", action="store_true", help="and their artifacts with them")
        p.add_argument("--finished-in-memory-s", type=float, default=600.0,
                       help="a finished job stays in the scheduler's memory this long; then it is read from the store")
        p.add_argument("--idempotency-hours", type=float, default=24.0,
                       help="a submission's idempotency key returns its first job for this long")

    def dashboard_flags(p):
        p.add_argument("--ws", dest="ws_url", default=os.environ.get("NATS_WS_URL"),
                       help="NATS websocket URL the page connects to (env NATS_WS_URL)")
        p.add_argument("--port", type=int, default=8222, help="the dashboard's HTTP port on 127.0.0.1")

    def dataset_limit_flags(p):
        p.add_argument("--dataset-max-mib", type=int, default=8192, help="the largest dataset file taken")
        p.add_argument("--dataset-max-rows", type=int, default=20_000_000, help="the most rows in a dataset")
        p.add_argument("--dataset-max-row-kib", type=int, default=2048, help="the longest row (one JSON line)")

    p = service("up", "embedded NATS + scheduler + artifact service + a local agent + the dashboard")
    agent_flags(p)
    dataset_limit_flags(p)
    sched_flags(p)
    dashboard_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_all))
    p = service("scheduler", "run the scheduler")
    sched_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_scheduler))
    p = service("dashboard", "serve the live dashboard page")
    dashboard_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_dashboard, owns_resources=False))
    p = service("agent", "run a node agent")
    agent_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_agent, owns_resources=False))

    def client(name, help_):
        p = sub.add_parser(name, help=help_)
        BusOptions.add_arguments(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--timeout", type=float, default=bus.DEFAULT_TIMEOUT)
        p.add_argument("--tenant", default=os.environ.get("JETLORA_TENANT"),
                       help="act as this tenant (env JETLORA_TENANT): its own jobs and quota; none: as an admin")
        return p

    p = client("submit", "submit a job (JSON or YAML file)")
    p.add_argument("job_file")
    p.set_defaults(fn=cmd_submit)
    p = client("jobs", "list jobs, newest first")
    p.add_argument("--state")
    p.add_argument("--node")
    p.add_argument("--limit", type=int, default=50, help="jobs per page (at most 1000)")
    p.add_argument("--after", type=int, help="the page after the one that printed `older jobs: --after N`")
    p.set_defaults(fn=cmd_jobs)
    p = client("nodes", "list nodes and their devices")
    p.set_defaults(fn=cmd_nodes)
    for name, help_, fn in (("job", "show one job", cmd_job),
                            ("cancel", "cancel a job (kill its trainer)", cmd_control),
                            ("stop", "stop a job and keep what it learnt", cmd_control),
                            ("pause", "checkpoint a job and free its device; resume goes on from there", cmd_control),
                            ("resume", "queue a paused job again, to go on from its checkpoint", cmd_control),
                            ("checkpoints", "a job's stored checkpoints with their losses", cmd_checkpoints),
                            ("watch", "follow a job's progress (replayed from its start)", cmd_watch),
                            ("why", "why a queued job waits, node by node", cmd_why)):
        p = client(name, help_)
        p.add_argument("job")
        p.set_defaults(fn=fn)
    p = client("events", "a job's events, a page at a time (through the API, no JetStream consumer)")
    p.add_argument("job")
    p.add_argument("--after", type=int, default=0, help="stream sequence to start after (the last page's `next`)")
    p.add_argument("--after-step", type=int, help="leave out progress and samples up to this step")
    p.add_argument("--limit", type=int, default=1000, help="events to print at most")
    p.set_defaults(fn=cmd_events)
    p = client("artifacts", "run the artifact service, or: ls / get / rm")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--shutdown-timeout", type=float, default=15.0, metavar="S",
                   help="on SIGINT/SIGTERM, what is left after this many seconds is ended and the exit is 1")
    asub = p.add_subparsers(dest="action")

    def action(name, help_):
        a = asub.add_parser(name, help=help_)
        BusOptions.add_arguments(a, repeated=True)
        a.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        a.add_argument("--tenant", default=os.environ.get("JETLORA_TENANT"),
                       help="as this tenant (env JETLORA_TENANT): the artifacts of its own jobs")
        return a

    a = action("ls", "list artifacts")
    a.add_argument("--job")
    a = action("get", "download one, sha256 checked")
    a.add_argument("job")
    a.add_argument("kind", choices=["peft", "gguf", "checkpoint", "tensorboard"])
    a.add_argument("-o", "--output", required=True)
    a = action("rm", "delete a job's artifacts")
    a.add_argument("job")
    a.add_argument("--kind", choices=["peft", "gguf", "checkpoint", "tensorboard"])
    dataset_limit_flags(p)
    p.set_defaults(fn=lambda a: cmd_artifacts(a) if a.action else run_service(a, run_artifacts))
    p = sub.add_parser("datasets", help="training data stored once and named by jobs: put / ls / show / get / rm")
    BusOptions.add_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    dsub = p.add_subparsers(dest="action", required=True)

    def dataset_action(name, help_):
        d = dsub.add_parser(name, help=help_)
        BusOptions.add_arguments(d, repeated=True)
        d.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        d.add_argument("--tenant", default=os.environ.get("JETLORA_TENANT"),
                       help="as this tenant (env JETLORA_TENANT): its own datasets and those shared with it")
        return d

    d = dataset_action("put", "check a JSON-lines file row by row, then upload it")
    d.add_argument("file")
    d.add_argument("--name", help="what jobs call it (default: the file's name up to its first dot)")
    d.add_argument("--format", choices=["auto", "qa", "chat", "alpaca", "text"], default="auto")
    d.add_argument("--replace", action="store_true", help="replace a dataset of that name")
    d.add_argument("--share", metavar="TENANT,...", help="tenants whose jobs may train on it (default: admins' only)")
    d.add_argument("--description", default="")
    d = dataset_action("ls", "list datasets")
    d.add_argument("--format", choices=["qa", "chat", "alpaca", "text"])
    for verb, help_ in (("show", "its stats and first rows"), ("rm", "delete it"), ("get", "download it, sha256 checked")):
        d = dataset_action(verb, help_)
        d.add_argument("name")
        if verb == "get":
            d.add_argument("-o", "--output", required=True)
    p.set_defaults(fn=cmd_datasets)
    p = sub.add_parser("adapters", help="the adapter registry: ls / show / register / promote / rollback / retire")
    BusOptions.add_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    rsub = p.add_subparsers(dest="action", required=True)
    for verb, help_ in (("ls", "adapters, their versions and what each node loaded"), ("show", "one adapter"),
                        ("register", "a succeeded job's adapter as NAME's next version"),
                        ("promote", "NAME@N becomes what NAME serves"), ("rollback", "NAME serves its version before"),
                        ("retire", "NAME serves nothing; engines unload it")):
        r = rsub.add_parser(verb, help=help_)
        BusOptions.add_arguments(r, repeated=True)
        r.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        if verb == "ls":
            r.add_argument("--base-model")
        else:
            r.add_argument("name", help="NAME@N" if verb == "promote" else "NAME")
        if verb == "register":
            r.add_argument("job")
            r.add_argument("--promote", action="store_true")
    p.set_defaults(fn=cmd_adapters)
    p = sub.add_parser("demo", help="train a LoRA on a small local model end to end, on this machine")
    p.add_argument("--out", default="demo-out", help="where the model and the downloaded artifacts go")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--keep", action="store_true", help="keep the stack and the dashboard up after the run")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("estimate", help="a job's predicted peak GPU memory, from its model's config.json")
    p.add_argument("job_file")
    p.add_argument("--model-dir", help="where the job's base model is on this machine (default: its base_dir)")
    p.add_argument("--free", type=int, default=0, help="MiB a device has: say what would fit when the job needs more")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_estimate)
    p = sub.add_parser("permissions", help="write the per-role users and subject permissions for nats-server")
    p.add_argument("--nodes", default="", help="agent node ids, comma separated: one user each")
    p.add_argument("--tenants", default="", help="tenants, comma separated: one user each, confined to its own jobs")
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

