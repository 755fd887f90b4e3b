"""Where graders run, as the operator allows it: the flags `jetlora gateway` (its graders endpoints), `jetlora
agent` (its trainers' grpo jobs) and `jetlora scheduler` (the evals service's runs of samples) share, and what each
builds from them."""

from __future__ import annotations

import argparse
import logging
import os

from services.runtime import StartupError

log = logging.getLogger("jetlora")

TRAINER_ENV = {  # what a trainer reads (trainer/objectives/rollouts.py grader_context), from the agent's flags
    "judge_url": "JETLORA_JUDGE_URL",
    "judge_api_key": "JETLORA_JUDGE_API_KEY",
    "python_graders": "JETLORA_PYTHON_GRADERS",
    "judge_image_hosts": "JETLORA_JUDGE_IMAGE_HOSTS",
    "single_tenant": "JETLORA_SINGLE_TENANT",
}


def image_hosts(value: str | None) -> tuple[str, ...]:
    """The hosts --judge-image-hosts (or JETLORA_JUDGE_IMAGE_HOSTS) names, comma-separated."""
    return tuple(h.strip().lower() for h in (value or "").split(",") if h.strip())


def grader_flags(p: argparse.ArgumentParser, where: str) -> None:
    """--judge-url, --judge-api-key-file, --judge-image-hosts, --python-graders; `where` says what they govern, in
    the help."""
    p.add_argument(
        "--judge-url",
        metavar="URL",
        default=os.environ.get(TRAINER_ENV["judge_url"]) or None,
        help=f"the OpenAI-compatible engine that score_model and label_model graders ask {where} (e.g. a vLLM "
        "engine's http://host:8000/v1); without it model graders are refused (env JETLORA_JUDGE_URL)",
    )
    p.add_argument("--judge-api-key-file", metavar="FILE", help="the judge engine's API key, if it wants one")
    p.add_argument(
        "--judge-image-hosts",
        metavar="HOST[,HOST]",
        default=os.environ.get(TRAINER_ENV["judge_image_hosts"]) or None,
        help="hosts a model grader's input_image URL may name: the judge engine fetches such an image itself, so by "
        "default only data: URLs (the image in the request) are taken (env JETLORA_JUDGE_IMAGE_HOSTS)",
    )
    p.add_argument(
        "--python-graders",
        choices=["auto", "on", "off"],
        default=os.environ.get(TRAINER_ENV["python_graders"], "auto"),
        help=f"python graders {where}: auto runs them only where the sandbox isolates them fully (namespaces, a "
        "cgroup of their own, a system call filter; as root, or as a user with user namespaces and a delegated "
        "cgroup); "
        "on also where it cannot, on a node that serves one tenant (--single-tenant; no network or filesystem "
        "isolation: trusted graders only); off refuses them (env JETLORA_PYTHON_GRADERS)",
    )
    p.add_argument(
        "--single-tenant",
        action="store_true",
        default=os.environ.get(TRAINER_ENV["single_tenant"]) == "1",
        help="this node serves one tenant: only then may --python-graders on run graders unisolated where the "
        "sandbox cannot isolate them (env JETLORA_SINGLE_TENANT=1)",
    )


def judge_api_key(args) -> str | None:
    if not args.judge_api_key_file:
        return None
    try:
        with open(args.judge_api_key_file) as f:
            return f.read().strip()
    except OSError as e:
        raise StartupError(f"--judge-api-key-file {args.judge_api_key_file}: {e.strerror}") from None


def checked(context):
    """The context, where python graders may run as the flags ask (this machine probed once, before the service
    starts any process), and what they get here said in the log; else StartupError saying why."""
    from services.graders import sandbox

    why = sandbox.start_refusal(context)
    if why:
        raise StartupError(why)
    log.info("%s: %s", context.command, sandbox.describe(context))
    return context


def grader_context(args, command: str = "jetlora gateway"):
    """The gateway's graders endpoints' context, or (`command` "jetlora scheduler") the evals service's, which grades
    runs of samples made elsewhere."""
    from services.graders import GraderContext

    return checked(
        GraderContext(
            judge_url=args.judge_url,
            judge_api_key=judge_api_key(args),
            judge_image_hosts=image_hosts(args.judge_image_hosts),
            python_graders=args.python_graders,
            single_tenant=args.single_tenant,
            command=command,
        )
    )


def trainer_env(args) -> dict[str, str]:
    """The agent's trainers' environment for graders (the key's only where one is given, so that an operator's
    JETLORA_JUDGE_API_KEY in the agent's own environment still reaches them). Refused at start as the trainers would
    refuse their graders."""
    from services.graders import GraderContext

    checked(
        GraderContext(python_graders=args.python_graders, single_tenant=args.single_tenant, command="jetlora agent")
    )
    values = {
        "judge_url": args.judge_url,
        "judge_api_key": judge_api_key(args),
        "python_graders": args.python_graders,
        "judge_image_hosts": ",".join(image_hosts(args.judge_image_hosts)),
        "single_tenant": "1" if args.single_tenant else None,
    }
    return {TRAINER_ENV[k]: v for k, v in values.items() if v}
