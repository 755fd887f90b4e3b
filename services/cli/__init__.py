"""`jetlora`: run the services, submit and watch jobs, fetch artifacts. A thin client of the NATS endpoints.

Each module here registers its own sub-commands (its `register(sub)`); this one only puts them together."""

from __future__ import annotations

import argparse

from services.cli import adapters, artifacts, datasets, estimate, evals, gateway, jobs, serve, tenants, tools
from services.runtime import setup_logging

COMMANDS = (
    serve,
    jobs,
    tenants,
    artifacts,
    datasets,
    adapters,
    evals,
    gateway,
    tools,
    estimate,
)  # in the order `jetlora --help` lists them


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jetlora", description=__doc__.split("\n")[0])
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.verbose)
    return args.fn(args)
