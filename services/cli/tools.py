"""Commands that run here without the bus: the demo, nats-server's permissions, the schema files."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from services.cli import args as args_
from services.cli.client import EXIT_OK, EXIT_REJECTED


def register(sub: args_.SubCommands) -> None:
    p = sub.add_parser("demo", help="train a LoRA on a small local model end to end, on this machine")
    p.add_argument("--out", default="demo-out", help="where the model and the downloaded artifacts go")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--keep", action="store_true", help="keep the stack and the dashboard up after the run")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("permissions", help="write the per-role users and subject permissions for nats-server")
    p.add_argument("--nodes", default="", help="agent node ids, comma separated: one user each")
    p.add_argument("--tenants", default="", help="tenants, comma separated: one user each, confined to its own jobs")
    p.add_argument("--out")
    p.set_defaults(fn=cmd_permissions)
    p = sub.add_parser("schema", help="write the JSON Schemas and the AsyncAPI document into schemas/")
    p.add_argument("--out")
    p.set_defaults(fn=cmd_schema)


def cmd_demo(args) -> int:
    from services.cli.demo import run_demo  # the whole stack and the trainer's model builder: only when asked

    try:
        return asyncio.run(run_demo(Path(args.out), args.steps, args.keep))
    except KeyboardInterrupt:
        return EXIT_OK


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
        print(
            f"wrote {args.out}; give nats-server these variables: "
            + " ".join(env_var(u) for u in roles(nodes, tenants)),
            file=sys.stderr,
        )
    else:
        sys.stdout.write(block)
    return EXIT_OK


def cmd_schema(args) -> int:
    from schemas.export import write_all

    for path in write_all(Path(args.out) if args.out else None):
        print(path)
    return EXIT_OK
