"""`jetlora gateway` (the OpenAI-compatible API) and `jetlora keys` (its API keys, one tenant each)."""

from __future__ import annotations

import argparse
import json
import os
import time

from services.cli import args as args_
from services.cli.client import EXIT_OK, CommandFailed, run_client, show
from services.cli.grader_flags import grader_context, grader_flags
from services.cli.running import run_service
from services.cli.tinker_flags import tinker_flags, tinker_settings
from services.runtime import StartupError


def base_models(specs: list[str], accelerator: str, served_by: str, save_steps: int, rft: str = "") -> dict:
    """--base-model NAME=DIR, repeated: the `model` values the API takes and where nodes have them; --reinforcement-train
    the native settings of their reinforcement jobs."""
    from services.gateway.openai_map import BaseModel

    models, reinforcement = {}, reinforcement_train(rft)
    for spec in specs:
        name, _, base_dir = spec.partition("=")
        if not name or not os.path.isabs(base_dir):
            raise StartupError(f"--base-model {spec!r}: give NAME=DIR, DIR the absolute model directory on the nodes")
        models[name] = BaseModel(name, base_dir, accelerator, served_by, save_steps, reinforcement)
    return models


def reinforcement_train(text: str) -> dict:
    """--reinforcement-train's JSON object: train settings a grpo job takes (checked here, so that a mistake stops
    the gateway at start rather than refusing every reinforcement job)."""
    import msgspec

    from schemas.training import TrainConfig

    if not text:
        return {}
    try:
        settings = json.loads(text)
        if not isinstance(settings, dict) or {"method", "grader"} & set(settings):
            raise ValueError("give a JSON object of train settings other than method and grader")
        msgspec.convert({**settings, "method": "grpo"}, TrainConfig)
    except (ValueError, msgspec.ValidationError) as e:
        raise StartupError(f"--reinforcement-train: {e}; e.g. '{{\"max_completion_tokens\": 256}}'") from None
    return settings


async def run_gateway(nc, stop, args) -> None:
    from services.gateway.app import Gateway
    from services.gateway.files import UploadLimits

    models = base_models(args.base_model, args.accelerator, args.served_by, args.save_steps, args.reinforcement_train)
    tinker = tinker_settings(args)
    if args.file_max_mib < 1 or args.tenant_files_mib < args.file_max_mib:
        raise StartupError("--file-max-mib: give 1 or more, and --tenant-files-mib at least as much")
    uploads = UploadLimits(args.file_max_mib * 2**20, args.tenant_files_mib * 2**20)
    gateway = Gateway(
        nc, models, args.host, args.port, graders=grader_context(args), tinker_settings=tinker, uploads=uploads
    )
    try:
        await gateway.start()
    except OSError as e:
        raise StartupError(
            f"cannot listen on {args.host}:{args.port} ({e.strerror}); choose another with --port"
        ) from None
    print(f"gateway: http://{args.host}:{gateway.port}/v1", flush=True)
    await gateway.run(stop)


def cmd_keys(args) -> int:
    from services.gateway.keys import KeyStore, new_key
    from services.gateway.tinker.http import TINKER_PREFIX

    as_json = getattr(args, "json", False)

    async def go(nc) -> int:
        store = await KeyStore.open(nc.jetstream())
        if args.action == "create":
            try:
                key, record = new_key(args.tenant, args.label)
            except ValueError as e:  # a tenant that is no subject token, or a reserved one
                raise CommandFailed(f"--tenant: {e}") from None
            await store.put(record)
            if as_json:
                shown = {"key": key, "id": record.id, "tenant": record.tenant, "label": record.label}
                print(json.dumps(shown | {"created": record.created, "tinker_key": TINKER_PREFIX + key}))
            else:
                print(
                    f"{key}\n(tenant {record.tenant}, id {record.id}; shown once: it is stored hashed; for the Tinker "
                    f"API's client: TINKER_API_KEY={TINKER_PREFIX}{key})"
                )
        elif args.action == "ls":
            records = sorted(await store.records(), key=lambda r: r.created)
            show(
                records,
                as_json,
                lambda _: print("\n".join(f"{r.id}\t{r.tenant}\t{time.ctime(r.created)}\t{r.label}" for r in records)),
            )
        elif not await store.delete(args.id):
            raise CommandFailed(f"no key with id {args.id}; `jetlora keys ls` lists them")
        else:
            print(json.dumps({"id": args.id, "deleted": True}) if as_json else f"deleted key {args.id}")
        return EXIT_OK

    return run_client(args, go)


def register(sub: args_.SubCommands) -> None:
    p = args_.service(sub, "gateway", "serve the OpenAI-compatible fine-tuning API (files, jobs, events, checkpoints)")
    gateway_flags(p)
    p.set_defaults(fn=lambda a: run_service(a, run_gateway, owns_resources=False))
    p, actions = args_.group(sub, "keys", "the gateway's API keys, one tenant each: create / ls / rm")
    a = args_.action(actions, "create", "make a key for a tenant (printed once)")
    a.add_argument("--tenant", required=True)
    a.add_argument("--label", default="", help="what the key is for")
    args_.action(actions, "ls", "list keys (ids and tenants; never the secrets)")
    a = args_.action(actions, "rm", "delete a key: requests with it are refused from then on")
    a.add_argument("id")
    p.set_defaults(fn=cmd_keys)


def gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--base-model",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a base model jobs may name as `model`, and its directory on the nodes (repeat)",
    )
    p.add_argument(
        "--accelerator",
        choices=["gpu", "cpu", "any"],
        default="any",
        help="what the API's jobs train on (jetlora's `accelerator`)",
    )
    p.add_argument(
        "--served-by", choices=["vllm", "llamacpp"], default="vllm", help="the engines that serve the fine-tuned models"
    )
    p.add_argument("--save-steps", type=int, default=100, help="a checkpoint every N steps (the job's checkpoints)")
    p.add_argument(
        "--reinforcement-train",
        default="",
        metavar="JSON",
        help="native train settings of every reinforcement job, which OpenAI's API has no place for, e.g. "
        '\'{"max_completion_tokens": 256, "temperature": 0.8, "grpo_beta": 0.04}\' (schemas/json/ lists them); '
        "the request's hyperparameters apply on top",
    )
    tinker_flags(p)
    p.add_argument("--file-max-mib", type=int, default=512, help="the most one uploaded file may hold (POST /v1/files)")
    p.add_argument(
        "--tenant-files-mib",
        type=int,
        default=10240,
        help="the most a tenant's files may hold together (stored, and uploads under way); past it an upload is a 413",
    )
    grader_flags(p, "in /v1/fine_tuning/alpha/graders/run (jobs' graders run on the nodes: `jetlora agent`'s flags)")
