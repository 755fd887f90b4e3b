"""Client commands for jobs and nodes: submit, jobs, job, nodes, cancel, stop, watch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from schemas import names
from schemas.jobs import Accepted, SubmitReply, Unsure
from schemas.job_status import JobList, JobListQuery, JobQuery, JobReply
from schemas.nodes import NodeList
from services.cli.printable import cell, printable
from services import bus
from services.cli import args as args_
from services.cli.client import EXIT_OK, EXIT_REJECTED, EXIT_UNREACHABLE, CommandFailed, ask, run_client, show


def api(args) -> dict[str, str]:
    """The request subjects this command uses: the tenant's own with --tenant, else an admin's."""
    return names.jobs_api(names.check_tenant(args.tenant) if args.tenant else None)._asdict()


def _load_job_file(path: str) -> bytes:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        return json.dumps(yaml.safe_load(text)).encode()
    return text.encode()


def cmd_submit(args) -> int:
    payload = _load_job_file(args.job_file)

    async def go(nc):
        try:
            reply = await bus.request(nc, api(args)["submit"], payload, SubmitReply, timeout=args.timeout)
        except bus.PayloadTooLarge as e:
            raise CommandFailed(
                f"{e}. Send less inline `data` per job (a job's data travels in its submit message), "
                "or raise max_payload in the server's config",
                EXIT_REJECTED,
            ) from None
        if isinstance(reply, Accepted):
            print(reply.job if not args.json else msgspec.json.encode(reply).decode())
            return EXIT_OK
        if args.json:
            print(msgspec.json.encode(reply).decode())
        elif isinstance(reply, Unsure):
            print(f"unknown: job {reply.job} may or may not be stored: {printable(reply.reason)}", file=sys.stderr)
            return EXIT_UNREACHABLE
        else:
            for err in reply.errors:
                print(f"rejected: {err.field or '(request)'}: {printable(err.reason)}", file=sys.stderr)
        return EXIT_REJECTED

    return run_client(args, go)


def cmd_jobs(args) -> int:
    async def go(nc):
        query = JobListQuery(state=args.state, node=args.node, limit=args.limit, after=args.after)
        show(await ask(nc, api(args)["jobs"], query, JobList), args.json, _jobs_table)
        return EXIT_OK

    return run_client(args, go)


def where(j) -> str:
    """The devices a job holds, as the table shows them."""
    at = ",".join(map(str, j.devices)) if j.devices else "" if j.device is None else str(j.device)
    return f"{at} ({j.group})" if at and j.group else at


def _jobs_table(reply: JobList) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("job", "state", "node", "dev", "step", "loss", "label", "message")
    for j in reply.jobs:
        t.add_row(
            j.id,
            j.state,
            j.node or "",
            where(j),
            f"{j.step}/{j.steps}",
            "" if j.loss is None else f"{j.loss:.4f}",
            cell(j.label),
            cell(j.message[:80]),
        )
    Console().print(t)
    if reply.next is not None:
        print(f"older jobs: --after {reply.next}")


def cmd_job(args) -> int:
    async def go(nc):
        reply = await ask(nc, api(args)["job"], JobQuery(args.job), JobReply)
        print(msgspec.json.format(msgspec.json.encode(reply.job)).decode())
        return EXIT_OK

    return run_client(args, go)


def cmd_nodes(args) -> int:
    async def go(nc):
        show(await ask(nc, names.LIST_NODES, b"{}", NodeList), args.json, _nodes_table)
        return EXIT_OK

    return run_client(args, go)


def _nodes_table(reply: NodeList) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("node", "alive", "device", "free / total MiB", "jobs", "note")
    for n in reply.nodes:
        groups = {a.job: a.group for a in n.attempts if a.group}
        for d in [*n.devices] or [None]:  # type: ignore[list-item]  # a node without devices still gets a row
            shared = sorted({groups[j] for j in (d.jobs if d else []) if j in groups})
            t.add_row(
                n.node,
                "yes" if n.alive else "no",
                "" if d is None else f"{d.index} {d.name}",
                "" if d is None else f"{d.free_mib} / {d.total_mib}",
                "" if d is None else ",".join(d.jobs),
                cell(n.no_gpu_reason or ("co-training group " + ", ".join(shared) if shared else "")),
            )
        for e in n.engines:  # what its serving engines are doing, as the agent last read them
            load = e.error or (
                f"{e.running} running, {e.waiting} waiting, busy {e.busy_fraction:.0%}"
                + ("" if e.kv_usage is None else f", KV cache {e.kv_usage:.0%}")
            )
            t.add_row(n.node, "", "engine", "", "", cell(f"{e.engine}: {load}"))
    Console().print(t)


def cmd_control(args) -> int:
    subject = api(args)[args.command]

    async def go(nc):
        reply = await ask(nc, subject, JobQuery(args.job), JobReply)
        print(f"{args.command} asked of job {args.job}: {reply.job.state}")
        return EXIT_OK

    return run_client(args, go)


def cmd_why(args) -> int:
    """Why a job waits, node by node."""
    from schemas.job_status import JobWhy

    async def go(nc):
        reply = await ask(nc, api(args)["why"], JobQuery(args.job), JobWhy)
        if args.json:
            print(msgspec.json.encode(reply).decode())
            return EXIT_OK
        print(printable(reply.summary))
        for n in reply.nodes:
            print(f"  {printable(n.node)}: {printable(n.reason)}")
        return EXIT_OK

    return run_client(args, go)


def cmd_watch(args) -> int:
    from services.cli.watch import watch

    return run_client(args, lambda nc: watch(nc, args.job, as_json=args.json, tenant=args.tenant))


def cmd_events(args) -> int:
    """A job's events a page at a time through the API (no JetStream consumer needed)."""
    from schemas.events import EventPage, EventsQuery
    from services.cli.watch import describe

    async def go(nc):
        after, left = args.after, args.limit
        while left > 0:
            page = await ask(
                nc,
                api(args)["events"],
                EventsQuery(job=args.job, after=after, after_step=args.after_step, limit=min(left, 1000)),
                EventPage,
            )
            for entry in page.events:
                print(
                    msgspec.json.encode(entry).decode()
                    if args.json
                    else f"{entry.seq:>8}  {printable(entry.node):<12} {describe(entry.event)}"
                )
            after, left = page.next, left - len(page.events)
            if not page.more:
                break
        if not args.json:
            print(f"next page: --after {after}", file=sys.stderr)
        return EXIT_OK

    return run_client(args, go)


def cmd_checkpoints(args) -> int:
    from schemas.events import CheckpointList

    def table(reply: CheckpointList) -> None:
        for c in reply.checkpoints:
            loss = "" if c.loss is None else f"loss {c.loss:.4f}"
            eval_loss = "" if c.eval_loss is None else f"eval {c.eval_loss:.4f}"
            if c.eval_reward is not None:
                eval_loss = f"eval reward {c.eval_reward:.4f}"
            print(f"step {c.step}\t{loss}\t{eval_loss}\t{c.name}")

    async def go(nc):
        show(await ask(nc, api(args)["checkpoints"], JobQuery(args.job), CheckpointList), args.json, table)
        return EXIT_OK

    return run_client(args, go)


def register(sub: args_.SubCommands) -> None:
    p = args_.client(sub, "submit", "submit a job (JSON or YAML file)")
    p.add_argument("job_file")
    p.set_defaults(fn=cmd_submit)
    p = args_.client(sub, "jobs", "list jobs, newest first")
    p.add_argument("--state")
    p.add_argument("--node")
    p.add_argument("--limit", type=int, default=50, help="jobs per page (at most 1000)")
    p.add_argument("--after", type=int, help="the page after the one that printed `older jobs: --after N`")
    p.set_defaults(fn=cmd_jobs)
    p = args_.client(sub, "nodes", "list nodes and their devices")
    p.set_defaults(fn=cmd_nodes)
    for name, help_, fn in (
        ("job", "show one job", cmd_job),
        ("cancel", "cancel a job (kill its trainer)", cmd_control),
        ("stop", "stop a job and keep what it learnt", cmd_control),
        ("pause", "checkpoint a job and free its device; resume goes on from there", cmd_control),
        ("resume", "queue a paused job again, to go on from its checkpoint", cmd_control),
        ("checkpoints", "a job's stored checkpoints with their losses", cmd_checkpoints),
        ("watch", "follow a job's progress (replayed from its start)", cmd_watch),
        ("why", "why a queued job waits, node by node", cmd_why),
    ):
        p = args_.client(sub, name, help_)
        p.add_argument("job")
        p.set_defaults(fn=fn)
    p = args_.client(sub, "events", "a job's events, a page at a time (through the API, no JetStream consumer)")
    p.add_argument("job")
    p.add_argument("--after", type=int, default=0, help="stream sequence to start after (the last page's `next`)")
    p.add_argument("--after-step", type=int, help="leave out progress and samples up to this step")
    p.add_argument("--limit", type=int, default=1000, help="events to print at most")
    p.set_defaults(fn=cmd_events)
