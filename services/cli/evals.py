"""`jetlora evals create|ls|show|rm|run|runs|results`: evals (items, graders, sampling) and their runs, asked of the
evals service; and the per-version scores `jetlora adapters show` lists."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import msgspec

from schemas import names
from schemas.evals import (
    Criterion,
    EvalCreate,
    EvalList,
    EvalListQuery,
    EvalQuery,
    EvalReply,
    EvalRun,
    ItemsPage,
    ItemsQuery,
    RunList,
    RunListQuery,
    RunQuery,
    RunReply,
    RunRequest,
    Sampling,
)
from schemas.jobs import Error
from services import bus
from services.cli import args as args_
from services.cli.client import EXIT_FAILED, EXIT_OK, CommandFailed, ask, run_client, show

ENDED = ("completed", "failed", "canceled")


def split_version(text: str) -> tuple[str, int | None]:
    """NAME@N -> (NAME, N); NAME -> (NAME, None) (as `adapters promote` reads it)."""
    name, _, version = text.partition("@")
    if version and not version.isdigit():
        raise CommandFailed(f"{text}: write NAME@N, N a version number")
    return name, int(version) if version else None


def criterion(text: str) -> Criterion:
    """A grader's JSON (or @FILE holding it), with an optional pass_threshold beside its fields."""
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    try:
        raw = json.loads(text)
        threshold = raw.pop("pass_threshold", None) if isinstance(raw, dict) else None
        return msgspec.convert({"grader": raw, "pass_threshold": threshold}, Criterion)
    except (ValueError, msgspec.ValidationError) as e:
        raise CommandFailed(f"--grader {text[:60]!r}: {e}") from None


def run_line(r: EvalRun) -> str:
    scores = ""
    if r.summary is not None:
        scores = "  " + ", ".join(
            f"{g.name} {g.mean:.3f} [{g.low:.3f}, {g.high:.3f}] pass {g.pass_rate:.0%}" for g in r.summary.graders
        )
    job = f"  job {r.job}" if r.job else ""
    note = f" ({r.via_note})" if r.via_note else ""
    return f"{r.id}  eval {r.eval}  {r.model}  {r.state}{job}  via {r.via}{note}{scores}"


async def version_scores(nc, tenant: str | None, adapter: str) -> list[str]:
    """Each version's eval scores, for `adapters show` (none when no evals service answers)."""
    try:
        reply = await bus.request(nc, names.evals_api(tenant).runs, RunListQuery(adapter=adapter), RunList | Error)
    except bus.RequestError:
        return []
    if isinstance(reply, Error):
        return [f"  eval scores: not read ({reply.error})"]
    if not reply.runs:
        return []
    lines = ["  eval scores:"]
    for r in sorted(reply.runs, key=lambda r: (r.version or 0, r.created)):
        lines.append(f"   @{r.version}  " + run_line(r))
    return lines


async def _create(nc, args):
    request = EvalCreate(
        name=args.name,
        dataset=args.dataset,
        criteria=[criterion(g) for g in args.grader],
        sampling=Sampling(temperature=args.temperature, max_tokens=args.max_tokens, n=args.n, seed=args.seed),
        title=args.title,
    )
    return await ask(nc, names.evals_api(args.tenant).create, request, EvalReply)


async def _run(nc, args):
    api = names.evals_api(args.tenant)
    if (args.model is None) == (args.base is None):
        raise CommandFailed("name what to grade: --model NAME[@V] or --base MODEL")
    adapter, version = split_version(args.model) if args.model else (None, None)
    request = RunRequest(
        eval=args.eval,
        adapter=adapter,
        version=version,
        base_model=args.base,
        base_dir=args.base_dir,
        accelerator=args.accelerator,
        dataset=args.dataset,
        via=args.via,
    )
    reply = await ask(nc, api.run, request, RunReply)
    deadline = time.monotonic() + args.wait
    while args.wait and reply.run.state not in ENDED and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        reply = await ask(nc, api.run_show, RunQuery(run=reply.run.id), RunReply)
    return reply


def _print_eval(r: EvalReply) -> None:
    e = r.eval
    print(f"{e.name}: dataset {e.dataset}  sampling {msgspec.json.encode(e.sampling).decode()}")
    for c in e.criteria:
        print(f"  {c.grader.name} ({msgspec.to_builtins(c.grader)['type']}, passes at {c.threshold()})")


def cmd_evals(args) -> int:
    async def go(nc):
        api = names.evals_api(args.tenant)
        if args.action == "create":
            show(await _create(nc, args), args.json, _print_eval)
        elif args.action == "ls":
            reply = await ask(nc, api.list, EvalListQuery(), EvalList)
            show(reply, args.json, lambda r: [print(f"{e.name}  dataset {e.dataset}") for e in r.evals])
        elif args.action in ("show", "rm"):
            subject = api.show if args.action == "show" else api.delete
            show(await ask(nc, subject, EvalQuery(name=args.name), EvalReply), args.json, _print_eval)
        elif args.action == "run":
            reply = await _run(nc, args)
            show(reply, args.json, lambda r: print(run_line(r.run)))
            return EXIT_OK if reply.run.state != "failed" else EXIT_FAILED
        elif args.action == "runs":
            reply = await ask(nc, api.runs, RunListQuery(eval=args.eval), RunList)
            show(reply, args.json, lambda r: [print(run_line(x)) for x in r.runs])
        else:
            reply = await ask(nc, api.items, ItemsQuery(run=args.run, limit=args.limit), ItemsPage)
            if not args.json and reply.via:
                print(f"run {args.run}: sampled by {reply.via}", file=sys.stderr)
            show(reply, args.json, lambda r: [print(msgspec.json.encode(i).decode()) for i in r.items])
        return EXIT_OK

    return run_client(args, go)


def register(sub: args_.SubCommands) -> None:
    p, actions = args_.group(sub, "evals", "evals: items, graders, sampling; runs against a base or an adapter")
    tenant = "act as this tenant (env JETLORA_TENANT): its own evals; none: an admin's"
    c = args_.action(actions, "create", "a new eval", tenant)
    c.add_argument("name")
    c.add_argument("--dataset", required=True, help="its items: an rft dataset (`jetlora datasets put --format rft`)")
    c.add_argument("--grader", action="append", required=True, help="OpenAI's grader JSON, or @FILE (repeat)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--n", type=int, default=1, help="completions per item")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--title", default="")
    args_.action(actions, "ls", "evals", tenant)
    for verb, help_ in (("show", "one eval"), ("rm", "delete an eval and its runs")):
        args_.action(actions, verb, help_, tenant).add_argument("name")
    r = args_.action(actions, "run", "run an eval against an adapter version or a base model", tenant)
    r.add_argument("eval")
    r.add_argument("--model", help="a registered adapter: NAME (the version it serves) or NAME@V")
    r.add_argument("--base", help="a base model's catalog name")
    r.add_argument("--base-dir", required=True, help="the base model's directory on the nodes")
    r.add_argument("--accelerator", choices=["gpu", "cpu", "any"], default="gpu")
    r.add_argument("--dataset", help="other items than the eval's dataset")
    r.add_argument(
        "--via",
        choices=["auto", "engine", "trainer"],
        default="auto",
        help="what samples it: auto (default) an engine that serves NAME@V now where there is one (what users get), "
        "else the trainer; or force either",
    )
    r.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for it to end")
    args_.action(actions, "runs", "eval runs and their scores", tenant).add_argument("--eval")
    i = args_.action(actions, "results", "a run's per-item outputs and scores (JSON lines)", tenant)
    i.add_argument("run")
    i.add_argument("--limit", type=int, default=100)
    p.set_defaults(fn=cmd_evals)
