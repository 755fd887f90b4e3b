"""The shapes every `jetlora` sub-command takes: a service's flags, a client's, a nested action's."""

from __future__ import annotations

import argparse
import os

from services import bus
from services.connection import BusOptions

SubCommands = argparse._SubParsersAction  # what add_subparsers() returns; each cli module registers on it


def service(sub: SubCommands, name: str, help_: str) -> argparse.ArgumentParser:
    """A long-running service: NATS flags, heartbeats, and how long SIGTERM waits."""
    p = sub.add_parser(name, help=help_)
    BusOptions.add_arguments(p)
    service_flags(p)
    return p


def service_flags(p: argparse.ArgumentParser, heartbeat_help: str | None = None) -> None:
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help=heartbeat_help)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=15.0,
        metavar="S",
        help="on SIGINT/SIGTERM, what is left after this many seconds is ended and the exit is 1",
    )


def client(sub: SubCommands, name: str, help_: str) -> argparse.ArgumentParser:
    """A one-shot request to the services: NATS flags, --json, --timeout and --tenant."""
    p = sub.add_parser(name, help=help_)
    BusOptions.add_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=bus.DEFAULT_TIMEOUT)
    p.add_argument(
        "--tenant",
        default=os.environ.get("JETLORA_TENANT"),
        help="act as this tenant (env JETLORA_TENANT): its own jobs and quota; none: as an admin",
    )
    return p


def group(sub: SubCommands, name: str, help_: str) -> tuple[argparse.ArgumentParser, SubCommands]:
    """A command with actions of its own (`jetlora datasets put ...`): the command and where its actions go."""
    p = sub.add_parser(name, help=help_)
    BusOptions.add_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p, p.add_subparsers(dest="action", required=True)


def action(actions: SubCommands, name: str, help_: str, tenant_help: str | None = None) -> argparse.ArgumentParser:
    """One action of a group; its NATS flags and --json may also come after it. tenant_help: it takes --tenant."""
    a = actions.add_parser(name, help=help_)
    BusOptions.add_arguments(a, repeated=True)
    a.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    if tenant_help is not None:
        a.add_argument("--tenant", default=os.environ.get("JETLORA_TENANT"), help=tenant_help)
    return a


def dataset_limits(p: argparse.ArgumentParser) -> None:
    """What the artifact service takes as a dataset (it runs under `up` and `artifacts`)."""
    p.add_argument("--dataset-max-mib", type=int, default=8192, help="the largest dataset file taken")
    p.add_argument("--dataset-max-rows", type=int, default=20_000_000, help="the most rows in a dataset")
    p.add_argument("--dataset-max-row-kib", type=int, default=2048, help="the longest row (one JSON line)")
