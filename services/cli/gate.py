"""`jetlora adapters promote NAME@V --gate EVAL [--margin M]`: the registry keeps the gate and decides it
(services/registry/gate.py); this waits for that decision, printing where it stands, up to the gate's deadline.
Leaving early (Ctrl-C, --no-wait) leaves the gate running: `jetlora adapters show NAME` prints how it ended."""

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
    """Until the registry decides the gate it started for NAME@version: the reply then, and the exit code."""
    gate = reply.alias.gate
    if gate is None or gate.version != version:
        return reply, EXIT_OK if reply.alias.current == version else EXIT_REJECTED
    started, said = gate.started, ""
    while True:
        now_gate = reply.alias.gate
        if now_gate is None or now_gate.started != started:
            break
        if now_gate.note != said:
            said = now_gate.note
            print(f"gate {now_gate.eval} of {reply.alias.name}@{version}: {said}", file=sys.stderr, flush=True)
        if time.time() > now_gate.deadline + 60:  # the registry's own deadline passed long since: it is not deciding
            print("the registry has not decided the gate by its deadline; is it running?", file=sys.stderr)
            return reply, EXIT_REJECTED
        await asyncio.sleep(POLL_S)
        reply = await ask(nc, names.ADAPTERS.show, AdapterQuery(name=reply.alias.name), AdapterReply)
    a = reply.alias
    print(a.last_gate, file=sys.stderr, flush=True)
    return reply, EXIT_OK if a.current == version and a.last_gate.startswith("gate passed") else EXIT_REJECTED
