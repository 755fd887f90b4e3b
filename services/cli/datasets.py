"""Client commands for datasets: put (checked here, then streamed and checked again by the service), ls, show,
get, rm."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from schemas import names
from schemas.dataset_check import DatasetInvalid, check_file
from schemas.datasets import (
    FORMATS,
    DatasetDeleted,
    DatasetInfo,
    DatasetList,
    DatasetListQuery,
    DatasetQuery,
    DatasetReply,
    DatasetUpload,
    check_new_name,
)
from services.cli import args as args_
from services.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_UNREACHABLE,
    CommandFailed,
    ask,
    run_client,
    show,
)


def describe(d: DatasetInfo) -> list[str]:
    s = d.stats
    lines = [
        f"{d.name}: {s.rows:,} {s.format} rows, {d.size / 2**20:,.1f} MiB, sha256 {d.sha256}, stored {d.created}",
        f"characters per row: {s.chars_mean:,.0f} on average, {s.chars_max:,} at most",
    ]
    if s.roles:
        lines.append(
            "messages by role: "
            + ", ".join(f"{role} {n:,}" for role, n in sorted(s.roles.items()))
            + f"; assistant turns learnt: {s.turns_trained:,}"
        )
    if d.description:
        lines.append(f"description: {d.description}")
    lines += ["first rows:"] + [f"  {row}" for row in s.head]
    return lines


def _refused_input(args) -> str:
    """What is wrong with the command's own input, checked before anything is sent ('' when nothing is): the
    names and tenants the subjects and the service would refuse, each named with its fix."""
    if args.action == "get" and args.tenant:
        return (
            "a tenant's users cannot download datasets (the object store is not theirs to read); an admin "
            "can, with `jetlora datasets get NAME`"
        )
    problems = [_why_not(names.check_tenant, args.tenant, "--tenant: ")] if args.tenant else []
    if args.action == "put":
        problems += [_why_not(names.check_tenant, t, "--share: ") for t in _shared(args)]
        problems.append(_why_not(check_new_name, _put_name(args), suffix="; give one with --name"))
    elif args.action != "ls":
        problems.append(_why_not(lambda name: names.check_token(name, "dataset name"), args.name))
    return next((p for p in problems if p), "")


def _why_not(check, value: str, prefix: str = "", suffix: str = "") -> str:
    try:
        check(value)
    except ValueError as e:
        return f"{prefix}{e}{suffix}"
    return ""


def _shared(args) -> list[str]:
    return [t for t in (args.share or "").split(",") if t]


def _put_name(args) -> str:
    return args.name or Path(args.file).name.split(".")[0]


def cmd_datasets(args) -> int:
    """`jetlora datasets ACTION`: the command's own input checked before anything is sent, then the action."""
    if refused := _refused_input(args):
        print(f"error: {refused}", file=sys.stderr)
        return EXIT_REJECTED
    if args.action == "put" and (not os.access(args.file, os.R_OK) or not Path(args.file).is_file()):
        print(f"error: cannot read {args.file}", file=sys.stderr)
        return EXIT_FAILED
    action = {"put": _cmd_put, "ls": _cmd_ls, "show": _cmd_show, "rm": _cmd_rm, "get": _cmd_get}[args.action]

    async def go(nc) -> int:
        await action(nc, args)
        return EXIT_OK

    return run_client(args, go)


async def _cmd_put(nc, args) -> None:
    """`datasets put FILE`: streamed to the service, which checks every row; what it stored is printed."""
    upload = DatasetUpload(format=args.format, replace=args.replace, description=args.description, share=_shared(args))
    stored = await _put(nc, args, _put_name(args), upload)
    show(DatasetReply(stored), args.json, lambda _: print("\n".join(describe(stored))))


async def _cmd_ls(nc, args) -> None:
    """`datasets ls`: one line a dataset."""
    reply = await ask(nc, names.datasets_api(args.tenant).list, DatasetListQuery(format=args.format), DatasetList)
    show(reply, args.json, lambda _: _print_rows(reply.datasets))


def _print_rows(datasets: list[DatasetInfo]) -> None:
    """name, format, rows, bytes, sha256 (its start), stored: tab-separated."""
    for d in datasets:
        print(f"{d.name}\t{d.stats.format}\t{d.stats.rows}\t{d.size}\t{d.sha256[:16]}\t{d.created}")


async def _cmd_show(nc, args) -> None:
    """`datasets show NAME`: its stats and first rows."""
    reply = await ask(nc, names.datasets_api(args.tenant).show, DatasetQuery(name=args.name), DatasetReply)
    show(reply, args.json, lambda _: print("\n".join(describe(reply.dataset))))


async def _cmd_rm(nc, args) -> None:
    """`datasets rm NAME`: refused while unfinished jobs name it, unless --force."""
    query = DatasetQuery(name=args.name, force=args.force)
    reply = await ask(nc, names.datasets_api(args.tenant).delete, query, DatasetDeleted)
    print(f"deleted {reply.name}")


async def _cmd_get(nc, args) -> None:
    """`datasets get NAME -o FILE`: downloaded, sha256 checked."""
    await get(nc, args.name, args.output)


async def put(
    nc, path: str | os.PathLike, name: str, upload: DatasetUpload | None = None, tenant: str | None = None
) -> DatasetInfo:
    """What `jetlora datasets put` does once connected (bench/dataset_upload.py measures this): send the file as it
    is read; the service checks every row as it arrives and refuses at the first bad one, storing nothing."""
    from services.transfer.sender import upload_dataset

    return await upload_dataset(nc, name, path, upload, tenant=tenant)


async def _put(nc, args, name: str, upload: DatasetUpload) -> DatasetInfo:
    """`datasets put` once connected: a refusal is rejected input (exit 2), an artifact service that never
    answered is unreachable (exit 3); neither is a traceback."""
    from services.transfer.sender import Refusal, UploadError

    try:
        return await put(nc, args.file, name, upload, tenant=args.tenant)
    except Refusal as e:  # at its first bad row: the rest of the file is checked here, for all of them
        raise CommandFailed(
            f"the artifact service refused {args.file}: {e}{await _bad_rows(args.file, upload)}", EXIT_REJECTED
        ) from None
    except UploadError as e:
        raise CommandFailed(str(e), EXIT_UNREACHABLE) from None
    except TimeoutError:  # the bus's (nats' is one): run_client says so
        raise
    except OSError as e:  # the file, not the bus (run_client would call it unreachable)
        raise CommandFailed(f"cannot read {args.file}: {e}") from None


async def _bad_rows(path: str | os.PathLike, upload: DatasetUpload) -> str:
    """The file's bad rows (its first ten), from a check here: the service stops at the first."""
    try:
        await asyncio.to_thread(check_file, path, upload.format)
    except DatasetInvalid as e:
        return "\n  the file's bad rows, checked here:\n    " + "\n    ".join(e.errors)
    except OSError:
        pass
    return ""


async def get(nc, name: str, output: str | os.PathLike) -> None:
    from services.transfer.datasets import find_dataset
    from services.transfer.download import DownloadError, fetch_object

    info = await find_dataset(nc.jetstream(), names.check_token(name, "dataset name"))
    if info is None:
        raise CommandFailed(f"no dataset named {name}; `jetlora datasets ls` lists them")
    try:
        await fetch_object(nc.jetstream(), names.DATASETS_BUCKET, name, output, info.sha256)
    except DownloadError as e:
        raise CommandFailed(str(e)) from None
    except TimeoutError:  # the bus's (nats' is one): run_client says so
        raise
    except OSError as e:  # not the bus's: run_client would call it unreachable
        raise CommandFailed(f"cannot write {output}: {e}") from None
    print(f"{output}\t{info.size} bytes\tsha256 {info.sha256} verified")


def register(sub: args_.SubCommands) -> None:
    p, actions = args_.group(sub, "datasets", "training data stored once and named by jobs: put / ls / show / get / rm")
    tenant = "as this tenant (env JETLORA_TENANT): its own datasets and those shared with it"
    d = args_.action(actions, "put", "upload a JSON-lines file; the service checks every row as it arrives", tenant)
    d.add_argument("file")
    d.add_argument("--name", help="what jobs call it (default: the file's name up to its first dot)")
    d.add_argument("--format", choices=["auto", *FORMATS], default="auto")
    d.add_argument("--replace", action="store_true", help="replace a dataset of that name")
    d.add_argument("--share", metavar="TENANT,...", help="tenants whose jobs may train on it (default: admins' only)")
    d.add_argument("--description", default="")
    d = args_.action(actions, "ls", "list datasets", tenant)
    d.add_argument("--format", choices=list(FORMATS))
    for verb, help_ in (
        ("show", "its stats and first rows"),
        ("rm", "delete it"),
        ("get", "download it, sha256 checked"),
    ):
        d = args_.action(actions, verb, help_, tenant)
        d.add_argument("name")
        if verb == "get":
            d.add_argument("-o", "--output", required=True)
        if verb == "rm":
            d.add_argument(
                "--force",
                action="store_true",
                help="delete it even while unfinished jobs name it (they fail where it was not fetched)",
            )
    p.set_defaults(fn=cmd_datasets)
