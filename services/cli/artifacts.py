"""Client commands for artifacts: ls, get (streamed, sha256 checked), rm."""

from __future__ import annotations

from schemas import names
from schemas.artifacts import ArtifactList, ArtifactQuery, Deleted
import argparse

from services.cli import args as args_
from services.cli.client import EXIT_OK, CommandFailed, ask, run_client, show


def cmd_artifacts(args) -> int:
    tenant = getattr(args, "tenant", None)
    subjects = names.artifacts_api(names.check_tenant(tenant) if tenant else None)

    async def go(nc):
        if args.action == "ls":
            reply = await ask(nc, subjects.list, ArtifactQuery(job=args.job), ArtifactList)
            show(
                reply,
                args.json,
                lambda r: [print(f"{a.name}\t{a.size}\t{a.sha256[:16]}\t{a.created}") for a in r.artifacts],
            )
        elif args.action == "rm":
            reply = await ask(nc, subjects.delete, ArtifactQuery(job=args.job, kind=args.kind), Deleted)
            print("\n".join(reply.names) or "nothing to delete")
        else:
            from services.transfer.download import DownloadError, download

            try:
                info = await download(nc, args.job, args.kind, args.output)
            except DownloadError as e:
                raise CommandFailed(str(e)) from None
            print(f"{args.output}\t{info.size} bytes\tsha256 {info.sha256} verified")
        return EXIT_OK

    return run_client(args, go)


KINDS = ["peft", "gguf", "checkpoint", "tensorboard"]


def register(sub: args_.SubCommands) -> None:
    """`artifacts` alone runs the artifact service; with an action it is a client of it."""
    from services.cli.running import run_service
    from services.cli.serve import run_artifacts

    p = args_.client(sub, "artifacts", "run the artifact service, or: ls / get / rm")
    actions = p.add_subparsers(dest="action")
    args_.service_flags(p, heartbeat_help=argparse.SUPPRESS)
    args_.dataset_limits(p)
    tenant = "as this tenant (env JETLORA_TENANT): the artifacts of its own jobs"
    a = args_.action(actions, "ls", "list artifacts", tenant)
    a.add_argument("--job")
    a = args_.action(actions, "get", "download one, sha256 checked", tenant)
    a.add_argument("job")
    a.add_argument("kind", choices=KINDS)
    a.add_argument("-o", "--output", required=True)
    a = args_.action(actions, "rm", "delete a job's artifacts", tenant)
    a.add_argument("job")
    a.add_argument("--kind", choices=KINDS)
    p.set_defaults(fn=lambda a: cmd_artifacts(a) if a.action else run_service(a, run_artifacts))
