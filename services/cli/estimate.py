"""`jetlora estimate JOB [JOB...]`: the job's predicted peak GPU memory, from its model's config on this machine,
before submitting it (the scheduler sizes `gpu_mib: 0` jobs the same way); for several jobs, what they take
co-trained in one group (the base once, each job's own state on top)."""

from __future__ import annotations

import sys

import msgspec

from schemas.job_checks import parse_job_request
from services import graders
from schemas.co_train import group_estimate, group_key, why_alone
from schemas.memory import estimate, what_would_fit
from schemas.validate import InvalidRequest
from services.agent.models import read_shape
from services.cli import args as args_
from services.cli.client import EXIT_OK, EXIT_REJECTED
from services.cli.jobs import _load_job_file


def cmd_estimate(args) -> int:
    requests = []
    for job_file in args.job_file:
        try:
            requests.append(parse_job_request(_load_job_file(job_file), graders.check))
            shape = read_shape(args.model_dir or requests[0].base_dir)
        except (InvalidRequest, ValueError) as e:
            print(
                f"{job_file}: {e}"
                + ("" if args.model_dir else "; give --model-dir where the model is on this machine"),
                file=sys.stderr,
            )
            return EXIT_REJECTED
    if len(requests) > 1:
        return _group(args, shape, requests)
    request = requests[0]
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


def _group(args, shape, requests) -> int:
    """Several jobs co-trained in one group: the base once, then each job's own part; or why one trains alone."""
    for job_file, request in zip(args.job_file, requests):
        if (why := why_alone(request)) is not None or group_key(request, shape) != group_key(requests[0], shape):
            print(
                f"{job_file} does not co-train with {args.job_file[0]}: {why or 'another base, precision, quantization or priority'}",
                file=sys.stderr,
            )
            return EXIT_REJECTED
    group = group_estimate(shape, requests)
    if args.json:
        print(msgspec.json.encode(group).decode())
        return EXIT_OK
    alone = sum(estimate(shape, r).mib for r in requests)
    print(f"~{group.mib:,} MiB for the group of {len(requests)} on one device (each alone: {alone:,} MiB in all)")
    print(f"  base and CUDA context, once: {group.base_mib:,} MiB")
    for job_file, own in zip(args.job_file, group.own_mib):
        print(f"  {job_file}: {own:,} MiB of its own (adapter, optimizer, activations, logits)")
    if args.free and group.mib > args.free:
        print(f"more than {args.free:,} MiB: fewer jobs in the group, or each job's own part smaller")
    return EXIT_OK


def register(sub: args_.SubCommands) -> None:
    p = sub.add_parser(
        "estimate",
        help="a job's predicted peak GPU memory, from its model's config.json; several: co-trained as a group",
    )
    p.add_argument("job_file", nargs="+")
    p.add_argument("--model-dir", help="where the job's base model is on this machine (default: its base_dir)")
    p.add_argument("--free", type=int, default=0, help="MiB a device has: say what would fit when the job needs more")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_estimate)
