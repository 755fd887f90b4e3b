"""`jetlora estimate JOB`: the job's predicted peak GPU memory, from its model's config on this machine, before
submitting it (the scheduler sizes `gpu_mib: 0` jobs the same way)."""

from __future__ import annotations

import sys

import msgspec

from schemas.job_checks import parse_job_request
from services import graders
from schemas.memory import estimate, what_would_fit
from schemas.validate import InvalidRequest
from services.agent.models import read_shape
from services.cli import args as args_
from services.cli.client import EXIT_OK, EXIT_REJECTED
from services.cli.jobs import _load_job_file


def cmd_estimate(args) -> int:
    try:
        request = parse_job_request(_load_job_file(args.job_file), graders.check)
        shape = read_shape(args.model_dir or request.base_dir)
    except (InvalidRequest, ValueError) as e:
        print(
            f"{args.job_file}: {e}"
            + ("" if args.model_dir else "; give --model-dir where the model is on this machine"),
            file=sys.stderr,
        )
        return EXIT_REJECTED
    need = estimate(shape, request)
    if args.json:
        print(msgspec.json.encode(need).decode())
        return EXIT_OK
    print(f"~{need.mib:,} MiB per device: {need.why()}")
    if args.free and need.mib > args.free:
        print(f"more than {args.free:,} MiB; what would fit:")
        for fix in what_would_fit(shape, request, args.free):
            print(f"  {fix}")
    return EXIT_OK


def register(sub: args_.SubCommands) -> None:
    p = sub.add_parser("estimate", help="a job's predicted peak GPU memory, from its model's config.json")
    p.add_argument("job_file")
    p.add_argument("--model-dir", help="where the job's base model is on this machine (default: its base_dir)")
    p.add_argument("--free", type=int, default=0, help="MiB a device has: say what would fit when the job needs more")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_estimate)
