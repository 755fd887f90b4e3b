"""A gate that passed, asked with --canary (schemas/served.py): instead of promoting everywhere, the registry starts
a canary that carries the eval for its nodes to run through their own engines: the candidate's trainer-side run (its
results artifact: the items, and what the trainer answered), the eval's graders (asked of the evals service, with a
time-out), the run's sampling, and the trainer-side score with its 95% interval (the gate's comparison). canary.py
decides it from what the nodes report. Nothing moves where the canary cannot start: the gate ends saying why."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import msgspec
from nats.aio.client import Client

from schemas import names
from schemas.evals import EvalQuery, EvalReply
from schemas.jobs import Error
from schemas.registry import Alias, Canary
from schemas.served import EVAL_SHARE, ServedEval, trainer_side
from services import bus
from services.registry.gate import ASK_TIMEOUT_S, Decided
from services.registry.store import AdapterRegistry, RegistryError

log = logging.getLogger(__name__)
Pick = Callable[[str, str, int, float], Awaitable[Canary]]  # (name, N or N%, version, deadline_s): canary.pick's


class CannotCarry(Exception):
    """The canary cannot carry the eval: what is missing."""


async def served_eval(nc: Client, alias: Alias, decided: Decided, deadline_s: float) -> ServedEval:
    """What the canary's nodes need to run the gate's eval and what their score must match. Raises CannotCarry,
    or bus.RequestError where the evals service does not answer."""
    gate, c, run = alias.gate, decided.comparison, decided.candidate
    assert gate is not None and c is not None and run is not None
    if run.results is None or run.sha256 is None:
        raise CannotCarry(f"the candidate's eval run {run.id} stored no results for the nodes to answer again")
    if c.candidate_low is None or c.candidate_high is None:
        raise CannotCarry(
            "the evals service's comparison gave no interval of the candidate's own score (an evals service older "
            "than gated canaries): upgrade it, or promote without --canary"
        )
    shown = await bus.request(
        nc, names.evals_api(alias.tenant).show, EvalQuery(name=gate.eval), EvalReply | Error, ASK_TIMEOUT_S
    )
    if isinstance(shown, Error):
        raise CannotCarry(f"eval {gate.eval}: {shown.error}")
    return ServedEval(
        eval=gate.eval,
        run=run.id,
        results=run.results,
        sha256=run.sha256,
        criteria=shown.eval.criteria,
        sampling=run.sampling or shown.eval.sampling,
        items=c.items,
        mean=c.candidate_mean,
        low=c.candidate_low,
        high=c.candidate_high,
        graders={g.name: g.mean for g in run.summary.graders} if run.summary else {},
        deadline_s=EVAL_SHARE * deadline_s,
    )


async def start(nc: Client, registry: AdapterRegistry, alias: Alias, decided: Decided, pick: Pick) -> None:
    """Start the gated canary of the alias's passed gate (compare-and-set, only while the alias holds that gate);
    where it cannot start, the gate ends saying so and what the name serves stays. The evals service not answering
    leaves the gate as it is, to be decided again on the next pass."""
    gate = alias.gate
    assert gate is not None and gate.canary is not None

    def same(a: Alias) -> bool:
        return a.gate is not None and a.gate.started == gate.started and a.gate.version == gate.version

    try:
        carried = await served_eval(nc, alias, decided, gate.canary_deadline_s)
        trial = await pick(alias.name, gate.canary, gate.version, gate.canary_deadline_s)
    except bus.RequestError as e:
        waiting = msgspec.structs.replace(
            gate, note=f"gate passed; the evals service does not answer for the canary's eval ({e}); asking again"
        )
        await registry.note_alias(alias.name, lambda a: msgspec.structs.replace(a, gate=waiting) if same(a) else None)
        return
    except (CannotCarry, RegistryError) as e:
        why = f"{decided.why}; but its canary could not start, so nothing moved: {e}"
        log.warning("%s@%d: %s", alias.name, gate.version, why)
        await registry.note_alias(
            alias.name, lambda a: msgspec.structs.replace(a, gate=None, last_gate=why) if same(a) else None
        )
        return
    trial = msgspec.structs.replace(trial, eval=carried)
    said = (
        f"{decided.why}; canary on {', '.join(trial.nodes)}: each runs eval {gate.eval} through its engine, to "
        f"score within {trainer_side(carried)}"
    )

    def begin(a: Alias) -> Alias:
        if not same(a):
            raise RegistryError("its gate ended meanwhile (a promote, rollback or retire)")
        return msgspec.structs.replace(a, canary=trial, retired=False, gate=None, last_gate=said)

    await registry.change_alias(alias.name, begin, None)
    log.info("%s@%d: %s", alias.name, gate.version, said)
