"""Client commands for the adapter registry: ls, show, register, promote, rollback, retire."""

from __future__ import annotations

import sys
import time

from schemas import names
from schemas.registry import (
    AdapterList,
    AdapterListQuery,
    AdapterQuery,
    AdapterReply,
    AliasRequest,
    PromoteRequest,
    RegisterRequest,
)
from schemas.served import describe as served_line
from schemas.served import trainer_side
from services.cli import args as args_
from services.cli import gate
from schemas.job_status import JobList, JobListQuery
from services.cli.client import EXIT_OK, CommandFailed, ask, run_client, show


def split_version(text: str) -> tuple[str, int | None]:
    """NAME@N -> (NAME, N); NAME -> (NAME, None)."""
    name, _, version = text.partition("@")
    if version and not version.isdigit():
        raise CommandFailed(f"{text}: write NAME@N, N a version number")
    return name, int(version) if version else None


def describe(r: AdapterReply) -> list[str]:
    a = r.alias
    serving = "retired" if a.retired else (f"serves {a.name}@{a.current}" if a.current else "serves no version yet")
    lines = [
        f"{a.name}: {serving}; versions 1-{a.latest}"
        + (f"; before: {', '.join(map(str, a.history))}" if a.history else "")
        + f" (change {a.changes}: --expect-changes {a.changes} refuses a promote if it changes first)"
    ]
    if a.canary is not None:
        left = a.canary.deadline - time.time()
        lines.append(
            f"  canary: @{a.canary.version} on {', '.join(a.canary.nodes)} (the others serve @{a.current}), "
            f"{max(0.0, left):.0f}s left to verify it"
        )
        if (e := a.canary.eval) is not None:
            lines.append(
                f"  gated: each canary node runs eval {e.eval} (run {e.run}'s items) through its engine, to score "
                f"within {trainer_side(e)}"
            )
    if a.last_rollout:
        lines.append(f"  last rollout: {a.last_rollout}")
    if a.gate is not None:
        lines.append(f"  gate: @{a.gate.version} on eval {a.gate.eval}: {a.gate.note}")
    if a.last_gate:
        lines.append(f"  last gate: {a.last_gate}")
    for v in r.versions:
        mark = (
            "*" if v.version == a.current else ("c" if a.canary is not None and v.version == a.canary.version else " ")
        )
        loss = "" if v.final_loss is None else f" loss {v.final_loss:.4f}"
        loss += "" if v.eval_loss is None else f" eval {v.eval_loss:.4f}"
        lines.append(
            f" {mark} @{v.version}  job {v.job}  {v.base_model}  r={v.r} alpha={v.alpha}{loss}  "
            f"peft {v.peft.sha256[:12]}" + (f"  gguf {v.gguf.sha256[:12]}" if v.gguf else "")
        )
    for n in r.nodes:
        smoke = f"  ({n.smoke.latency_ms:.0f} ms: {n.smoke.text.strip()[:40]!r})" if n.smoke else ""
        lines.append(f"   node {n.node} [{n.engine}]: @{n.version} {n.state}  {n.message}{smoke}")
        if (p := n.parity) is not None:
            verdict = "not judged" if p.within is None else ("within" if p.within else "BEYOND")
            floor = "" if p.floor_mean is None else f"  floor {p.floor_mean:.3g} (max {p.floor_max:.3g})"
            limit = "" if p.limit is None else f"  limit {p.limit:.3g}"
            lines.append(
                f"     parity @{n.version}: |Δ log p| mean {p.mean:.3g} max {p.max:.3g} over {p.tokens} tokens"
                f"{floor}{limit}: {verdict}" + (f" ({p.note})" if p.note else "")
            )
        if n.served is not None:
            gated = a.canary.eval if a.canary is not None and a.canary.version == n.version else None
            lines.append(f"     {served_line(gated, n.served)}")
    return lines


def cmd_adapters(args) -> int:
    async def go(nc):
        if args.action == "ls":
            reply = await ask(nc, names.ADAPTERS.list, AdapterListQuery(base_model=args.base_model), AdapterList)
            show(reply, args.json, lambda r: [print("\n".join(describe(a))) for a in r.adapters])
            return EXIT_OK
        if args.action == "register":
            job = args.job or await session_job(nc, args.from_session)
            reply = await ask(
                nc,
                names.ADAPTERS.register,
                RegisterRequest(name=args.name, job=job, promote=args.promote),
                AdapterReply,
            )
            if "lm_head" in reply.versions[-1].target_modules:
                print(
                    f"note: {args.name}@{reply.versions[-1].version} adapts lm_head (Tinker's train_unembed): vLLM and "
                    "llama.cpp serve no LoRA there, so no engine loads it; its session's sampler serves it. Train "
                    "with train_unembed=False for an adapter the engines serve.",
                    file=sys.stderr,
                )
        elif args.action == "show":
            from services.cli.evals import version_scores

            reply = await ask(nc, names.ADAPTERS.show, AdapterQuery(name=args.name), AdapterReply)
            scores = await version_scores(nc, None, args.name)  # each version's eval runs
            show(reply, args.json, lambda r: print("\n".join(describe(r) + scores)))
            return EXIT_OK
        else:
            name, version = split_version(args.name)
            seen = args.expect_changes  # what its caller saw (`adapters show` prints it): a change since refuses it
            if args.action == "promote":
                if version is None:
                    raise CommandFailed("say which version: jetlora adapters promote NAME@N")
                request, subject = (
                    PromoteRequest(
                        name=name,
                        version=version,
                        expect_changes=seen,
                        canary=args.canary,
                        canary_deadline_s=args.canary_deadline,
                        gate=gate.spec(args),
                    ),
                    names.ADAPTERS.promote,
                )
            else:
                request, subject = AliasRequest(name=name, expect_changes=seen), getattr(names.ADAPTERS, args.action)
            reply = await ask(nc, subject, request, AdapterReply)
            if args.action == "promote" and args.gate is not None and not args.no_wait:
                reply, code = await gate.wait(nc, reply, version)
                show(reply, args.json, lambda r: print("\n".join(describe(r))))
                return code
        show(reply, args.json, lambda r: print("\n".join(describe(r))))
        return EXIT_OK

    return run_client(args, go)


async def session_job(nc, model_id: str | None) -> str:
    """The job of a Tinker training model (the gateway labels each session job `tinker <model_id>`)."""
    if not model_id:
        raise CommandFailed("say which adapter: a JOB, or --from-session MODEL_ID")
    after, found = None, []
    while True:
        page = await ask(nc, names.LIST_JOBS, JobListQuery(limit=1000, after=after), JobList)
        found += [j.id for j in page.jobs if j.label == f"tinker {model_id}"]
        if page.next is None:
            break
        after = page.next
    sessions = list(dict.fromkeys(found))
    if len(sessions) != 1:  # a label is a submitter's to write: two alike are not guessed between
        raise CommandFailed(
            f"{len(sessions)} session jobs are labelled Tinker model {model_id}: give the JOB itself (`jetlora jobs`)"
            if sessions
            else f"no session job of Tinker model {model_id}; `jetlora jobs` lists them"
        )
    return sessions[0]


def register(sub: args_.SubCommands) -> None:
    p, actions = args_.group(
        sub, "adapters", "the adapter registry: ls / show / register / promote / rollback / retire"
    )
    for verb, help_ in (
        ("ls", "adapters, their versions and what each node loaded"),
        ("show", "one adapter"),
        ("register", "a succeeded job's adapter as NAME's next version"),
        ("promote", "NAME@N becomes what NAME serves"),
        ("rollback", "NAME serves its version before"),
        ("retire", "NAME serves nothing; engines unload it"),
    ):
        r = args_.action(actions, verb, help_)
        if verb == "ls":
            r.add_argument("--base-model")
        else:
            r.add_argument("name", help="NAME@N" if verb == "promote" else "NAME")
        if verb == "promote":
            r.add_argument(
                "--canary",
                metavar="N|N%",
                help="move it on N of the nodes serving NAME first (or N%% of "
                "them); the rest follow once those verify it, and a "
                "failure or mismatch there rolls it back by itself; with "
                "--gate, once the gate passes, and each of those nodes also "
                "runs the eval through its engine",
            )
            r.add_argument(
                "--canary-deadline",
                type=float,
                default=600.0,
                metavar="S",
                help="how long the canary nodes have to verify it (default 600)",
            )
            gate.add_arguments(r)
        if verb in ("promote", "rollback", "retire"):
            r.add_argument(
                "--expect-changes",
                type=int,
                metavar="N",
                help="refuse unless NAME is at change N, as `adapters show` printed it (compare-and-set)",
            )
        if verb == "register":
            r.add_argument("job", nargs="?", help="the job whose adapter it is")
            r.add_argument(
                "--from-session",
                metavar="MODEL_ID",
                help="or a Tinker training model's (its client finished its session): its model_id, <session>:train:<n>",
            )
            r.add_argument("--promote", action="store_true")
    p.set_defaults(fn=cmd_adapters)
