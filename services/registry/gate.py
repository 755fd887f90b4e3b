"""Gated promotes (schemas/gates.py): `adapters promote NAME@V --gate EVAL` (or a job's `register.gate`) stores a gate
in the alias and answers at once; this loop advances every gate under way, one short step a pass, each a request to
the evals service with a time-out (it owns the runs and their results; the registry never reads its bucket): the eval
runs a side lacks are started (as the alias's tenant), waited for on the registry's clock up to the gate's deadline,
then compared there, paired by item. The registry decides: the lower end of the 95% interval of (candidate -
incumbent) at least the margin promotes it (or, asked with --canary, starts a gated canary: gated_canary.py);
anything else leaves what the name serves as it was. The outcome, with its figures, is the alias's `last_gate`. A
plain promote, rollback or retire ends a gate under way."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import msgspec
from nats.aio.client import Client

from schemas import names
from schemas.engine_evals import TRAINER
from schemas.evals import EvalReply, EvalRun, RunList, RunListQuery, RunQuery, RunReply, RunRequest
from schemas.gates import CompareReply, CompareRequest, Comparison, Gate, GateSpec, unevaluated, verdict
from schemas.jobs import Error
from schemas.registry import AdapterReply, AdapterVersion, Alias
from services import bus
from services.controller import Controller
from services.job_records import JobRecords
from services.registry.store import AdapterRegistry, RegistryError

log = logging.getLogger(__name__)
Promoted = Callable[[Alias, int], Alias]  # the alias once it serves that version
Canaried = Callable[[Alias, "Decided"], Awaitable[None]]  # a passed gate's canary started (gated_canary.py)
CHECK_S = 1.0
ASK_TIMEOUT_S = 5.0
ENDED_BAD = ("failed", "canceled")


async def where(jobs: JobRecords, version: AdapterVersion, spec: GateSpec) -> tuple[str, str]:
    """(base_dir, accelerator) the eval runs are placed with: the version's job's, unless the gate names base_dir."""
    found = await jobs.find(version.job)
    if found is None:
        if spec.base_dir is None:
            raise RegistryError(
                f"the record of job {version.job}, which made {version.name}@{version.version}, is gone: give the "
                "gate base_dir (`--gate-base-dir`), where nodes hold the base model"
            )
        return spec.base_dir, "any"
    req = found[0].request
    return spec.base_dir or req.base_dir, req.accelerator


async def eval_exists(nc: Client, tenant: str | None, name: str) -> str | None:
    """Why the gate's eval cannot decide (None: it exists), asked of the evals service."""
    try:
        reply = await bus.request(nc, names.evals_api(tenant).show, {"name": name}, EvalReply | Error, ASK_TIMEOUT_S)
    except bus.RequestError as e:
        return f"the evals service does not answer ({e}); try again when it does"
    return reply.error if isinstance(reply, Error) else None


@dataclass
class Decided:
    """How a gate ended: passed or not, why (with the figures), and, decided by its runs, their comparison and the
    candidate's run (what a gated canary's nodes answer again through their engines)."""

    passed: bool
    why: str
    comparison: Comparison | None = None
    candidate: EvalRun | None = None


def begin(
    alias: Alias,
    spec: GateSpec,
    version: AdapterVersion,
    base_dir: str,
    accelerator: str,
    canary: tuple[str, float] | None = None,
) -> Alias:
    """The alias with a gate under way; `canary` (N or N%, its deadline): a gate that passes starts that canary."""
    now = time.time()
    incumbent = None if alias.retired else alias.current
    gate = Gate(
        eval=spec.eval,
        margin=spec.margin,
        version=version.version,
        incumbent=incumbent,
        base_model=version.base_model,
        base_dir=base_dir,
        accelerator=accelerator,
        started=now,
        deadline=now + spec.deadline_s,
        note="starting the eval runs",
        canary=canary[0] if canary else None,
        canary_deadline_s=canary[1] if canary else 600.0,
    )
    return msgspec.structs.replace(alias, gate=gate)


def _model(name: str, gate: Gate, version: int | None) -> str:
    return gate.base_model if version is None else f"{name}@{version}"


async def _run_for(nc: Client, alias: Alias, gate: Gate, version: int | None) -> EvalRun | str:
    """A completed run of the gate's eval on this side (reused), else one started now; a string says why not. Both
    sides are sampled by the trainer, like with like: the candidate is not served yet, so no engine could sample it,
    and an engine-sampled incumbent (another precision, another sampler) would not compare with it."""
    api = names.evals_api(alias.tenant)
    query = RunListQuery(eval=gate.eval, adapter=alias.name if version is not None else None)
    found = await bus.request(nc, api.runs, query, RunList | Error, ASK_TIMEOUT_S)
    if isinstance(found, RunList):
        done = [
            r
            for r in found.runs
            if r.state == "completed"
            and r.source is None
            and r.via == TRAINER
            and (r.adapter, r.version) == ((alias.name, version) if version is not None else (None, None))
            and r.base_model == gate.base_model
        ]
        if done:
            return max(done, key=lambda r: r.created)
    request = RunRequest(
        eval=gate.eval,
        adapter=alias.name if version is not None else None,
        version=version,
        base_model=gate.base_model if version is None else None,
        base_dir=gate.base_dir,
        accelerator=gate.accelerator,  # type: ignore[arg-type]
        name=f"gate of {alias.name}@{gate.version}",
        via="trainer",  # never auto: the incumbent is served, and auto would sample it through its engine
    )
    placed = await bus.request(nc, api.run, request, RunReply | Error, ASK_TIMEOUT_S)
    return placed.run if isinstance(placed, RunReply) else f"{placed.field}: {placed.error}"


async def _side(nc: Client, alias: Alias, gate: Gate, role: str) -> EvalRun | str:
    version = gate.version if role == "candidate" else gate.incumbent
    run_id = gate.candidate_run if role == "candidate" else gate.incumbent_run
    if run_id is None:
        return await _run_for(nc, alias, gate, version)
    shown = await bus.request(
        nc, names.evals_api(alias.tenant).run_show, RunQuery(run=run_id), RunReply | Error, ASK_TIMEOUT_S
    )
    return shown.run if isinstance(shown, RunReply) else f"its run {run_id}: {shown.error}"


async def step(nc: Client, alias: Alias, now: float) -> Gate | Decided:
    """One step of the alias's gate: the gate as it stands now (runs started, a note), or how it was decided."""
    gate = alias.gate
    assert gate is not None
    runs: dict[str, EvalRun] = {}
    for role in ("candidate", "incumbent"):
        run = await _side(nc, alias, gate, role)
        model = _model(alias.name, gate, gate.version if role == "candidate" else gate.incumbent)
        if isinstance(run, str):
            return Decided(False, unevaluated(model, role, f"its eval run could not be had: {run}"))
        if run.state in ENDED_BAD:
            return Decided(False, unevaluated(model, role, f"eval run {run.id} {run.state}: {run.message}"))
        runs[role] = run
        gate = msgspec.structs.replace(gate, **{f"{role}_run": run.id})
    pending = [f"{role} {r.id} {r.state}" for role, r in runs.items() if r.state != "completed"]
    if pending:
        if now > gate.deadline:
            return Decided(
                False,
                f"gate refused: its eval runs did not end within {gate.deadline - gate.started:.0f}s "
                f"({', '.join(pending)})",
            )
        return msgspec.structs.replace(gate, note=f"waiting for eval runs: {', '.join(pending)}")
    ask = CompareRequest(candidate=runs["candidate"].id, incumbent=runs["incumbent"].id)
    reply = await bus.request(nc, names.evals_api(alias.tenant).compare, ask, CompareReply | Error, ASK_TIMEOUT_S)
    if isinstance(reply, Error):
        return Decided(False, f"gate refused: the runs could not be compared: {reply.field}: {reply.error}")
    return Decided(*verdict(reply.comparison, gate.margin), reply.comparison, runs["candidate"])


async def advance(nc: Client, registry: AdapterRegistry, alias: Alias, promoted: Promoted, canaried: Canaried) -> None:
    """One step of a gate under way, written by compare-and-set only while the alias holds that same gate. A gate
    that passes promotes the candidate, or (asked with a canary) starts that canary through `canaried`."""
    gate = alias.gate
    assert gate is not None
    try:
        decided = await step(nc, alias, time.time())
    except bus.RequestError as e:
        decided = msgspec.structs.replace(gate, note=f"the evals service does not answer ({e}); asking again")

    def same(a: Alias) -> bool:
        return a.gate is not None and a.gate.started == gate.started and a.gate.version == gate.version

    if isinstance(decided, Gate):
        await registry.note_alias(alias.name, lambda a: msgspec.structs.replace(a, gate=decided) if same(a) else None)
        return
    (log.info if decided.passed else log.warning)("%s@%d: %s", alias.name, gate.version, decided.why)
    if not decided.passed:
        await registry.note_alias(
            alias.name, lambda a: msgspec.structs.replace(a, gate=None, last_gate=decided.why) if same(a) else None
        )
        return
    if gate.canary is not None:
        await canaried(alias, decided)
        return

    def promote(a: Alias) -> Alias:
        if not same(a):
            raise RegistryError("its gate ended meanwhile (a promote, rollback or retire)")
        return msgspec.structs.replace(promoted(a, gate.version), gate=None, last_gate=decided.why)

    await registry.change_alias(alias.name, promote, None)


def under_way(replies: dict[str, AdapterReply]) -> list[Alias]:
    """The aliases with a gate under way."""
    return [reply.alias for reply in replies.values() if reply.alias.gate is not None]


def controller(
    nc: Client, registry: AdapterRegistry, promoted: Promoted, canaried: Canaried
) -> Controller[dict[str, AdapterReply]]:
    """Advance every gate under way, a step each CHECK_S."""

    async def step_one(alias: Alias) -> None:
        try:
            await advance(nc, registry, alias, promoted, canaried)
        except RegistryError as e:
            log.info("gate of %s: %s", alias.name, e)

    return Controller("gates", CHECK_S, under_way, step_one)
