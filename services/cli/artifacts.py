"""Client commands for artifacts: ls, get (streamed, sha256 checked), rm."""

from __future__ import annotations

from schemas import names
from schemas.artifacts import ArtifactList, ArtifactQuery, Deleted
from services.cli.client import EXIT_OK, CommandFailed, ask, run_client, show


def cmd_artifacts(args) -> int:
    tenant = getattr(args, "tenant", None)
    subjects = names.artifacts_api(names.check_tenant(tenant) if tenant else None)
    async def go(nc):
        if args.action == "ls":
            reply = await ask(nc, subjects.list, ArtifactQuery(job=args.job), ArtifactList)
            show(reply, args.json,
                 lambda r: [print(f"{a.name}\t{a.size}\t{a.sha256[:16]}\t{a.created}") for a in r.artifacts])
        elif args.action == "rm":
            reply = await ask(nc, subjects.delete, ArtifactQuery(job=args.job, kind=args.kind), Deleted)
            print("\n".join(reply.names) or "nothing to delete")
        else:
            from services.artifacts.download import DownloadError, download

            try:
                info = await download(nc, args.job, args.kind, args.output)
            except DownloadError as e:
                raise CommandFailed(str(e)) from None
            print(f"{args.output}\t{info.size} bytes\tsha256 {info.sha256} verified")
        return EXIT_OK

    return run_client(args, go)
