"""`jetlora adapters promote NAME@V --gate EVAL [--margin M] [--canary N]`: the registry keeps the gate and decides
it (services/registry/gate.py); this waits for that decision, printing where it stands, up to the gate's deadline,
and with --canary for the gated canary it then starts (its nodes' served scores: schemas/served.py). Leaving early
(Ctrl-C, --no-wait) leaves them running: `jetlora adapters show NAME` prints how they ended."""

from __future__ import annotations

import asyncio
import sys
import time

from schemas import names
from schemas.gates import DEADLINE_S, GateSpec
from schemas.registry import AdapterQuery, AdapterReply
from services.cli.client import EXIT_OK, EXIT_REJECTED, ask

POLL_S = 1.0


def add_arguments(r) -> None:
    r.add_argument("--gate", metavar="EVAL", help="promote only if this eval says it beats what NAME serves now")
    r.add_argument(
        "--margin",
        type=float,
        default=0.0,
        metavar="M",
        help="the 95%% interval of (candidate - incumbent) on the eval's score must lie at or above M (default 0)",
    )
    r.add_argument(
        "--gate-deadline", type=float, default=DEADLINE_S, metavar="S", help="the eval runs' time to end (1800)"
    )
    r.add_argument("--gate-base-dir", metavar="DIR", help="where nodes hold the base model (default: the job's)")
    r.add_argument("--no-wait", action="store_true", help="start the gate and return; `adapters show` tells the end")


def spec(args) -> GateSpec | None:
    if args.gate is None:
        return None
    return GateSpec(eval=args.gate, margin=args.margin, deadline_s=args.gate_deadline, base_dir=args.gate_base_dir)


async def wait(nc, reply: AdapterReply, version: int) -> tuple[AdapterReply, int]:
    """Until the registry decides the gate it started for NAME@version, and the gated canary that gate started (if
    asked with --canary): the reply then, and the exit code."""
    gate = reply.alias.gate
    if gate is None or gate.version != version:
        return reply, EXIT_OK if reply.alias.current == version else EXIT_REJECTED
    started = gate.started
    ongoing = await _follow(
        nc,
        reply,
        lambda a: a.gate is not None and a.gate.started == started,
        lambda r: f"gate {gate.eval} of {r.alias.name}@{version}: {r.alias.gate.note if r.alias.gate else ''}",
        lambda a: a.gate.deadline if a.gate else 0.0,
    )
    if ongoing is None:
        return reply, EXIT_REJECTED
    reply, a = ongoing, ongoing.alias
    print(a.last_gate, file=sys.stderr, flush=True)
    if gate.canary is not None and a.last_gate.startswith("gate passed"):
        if a.canary is not None and a.canary.version == version:
            since = a.canary.started
            ended = await _follow(
                nc,
                reply,
                lambda a: a.canary is not None and a.canary.started == since,
                lambda r: f"canary of {r.alias.name}@{version}: {_canary_nodes(r)}",
                lambda a: a.canary.deadline if a.canary else 0.0,
            )
            if ended is None:
                return reply, EXIT_REJECTED
            reply, a = ended, ended.alias
        if a.last_rollout.startswith(f"canary of {a.name}@{version} "):  # (it may have ended between two looks)
            print(a.last_rollout, file=sys.stderr, flush=True)
    return reply, EXIT_OK if a.current == version and a.last_gate.startswith("gate passed") else EXIT_REJECTED


async def _follow(nc, reply: AdapterReply, ongoing, note, deadline) -> AdapterReply | None:
    """Poll `adapters show` while `ongoing(alias)`, printing `note(reply)` as it changes; the reply once it is over,
    None if the registry's own deadline passed long since (it is not deciding)."""
    said = ""
    while ongoing(reply.alias):
        if (now := note(reply)) != said:
            said = now
            print(said, file=sys.stderr, flush=True)
        if time.time() > deadline(reply.alias) + 60:
            print("the registry has not decided it by its deadline; is it running?", file=sys.stderr)
            return None
        await asyncio.sleep(POLL_S)
        reply = await ask(nc, names.ADAPTERS.show, AdapterQuery(name=reply.alias.name), AdapterReply)
    return reply


def _canary_nodes(r: AdapterReply) -> str:
    """Where each canary node stands: its state of the canary's version, and its served score once it has one."""
    c = r.alias.canary
    assert c is not None
    seen = {n.node: n for n in r.nodes if n.version == c.version and n.seq > c.after}
    said = []
    for node in c.nodes:
        n = seen.get(node)
        said.append(
            f"{node} {n.state if n else 'waiting'}" + (f" (served {n.served.mean:.3f})" if n and n.served else "")
        )
    return ", ".join(said)
