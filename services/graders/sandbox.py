"""Python graders, run in a sandbox process of their own, one process for a batch of samples, never in a service:
what this machine allows (probed once), the refusals that follow from it and the operator's flags, and the calls.

A sandbox (session.py) is isolated as isolation.py says where the machine allows it, bounded as a whole by a
cgroup of its own (cgroups.py: memory, processes, CPU) and filtered (syscalls.py); where it cannot be isolated, the
operator may still turn python graders on for trusted graders on a node that serves one tenant, run unisolated but
contained (a pid namespace or a cgroup of its own); where not even that holds, never.

Time is fixed at the start of each call: call_limit_s (start-up, the load and every sample at the wall limit, each
with grace), earlier still where the caller's own deadline (a request's sandbox time) is. A sample that overruns or
kills its worker is reported for that sample and the samples after it get a new process. A call that is cancelled
kills its sandbox before it returns. Every failure is reported for its sample (score 0), never raised."""

from __future__ import annotations

import asyncio
import functools
import subprocess
from dataclasses import dataclass
from typing import Any

from schemas.graders import GradeResult
from services.graders import blocking, cgroups, isolation, session
from services.graders.context import GraderContext
from services.graders.deadline import Deadline, earliest
from services.graders.session import GRACE_S, KILL_GRACE_S, RUNTIME, SERVER, START_S, UNRESPONSIVE, Outcome, Plan

__all__ = ["RUNTIME", "SERVER", "UNRESPONSIVE", "SandboxStatus", "call_limit_s", "refusal", "status"]


@dataclass(frozen=True)
class SandboxStatus:
    isolated: bool
    why_not: str = ""  # why it is not, where it is not
    bound: str = ""  # what bounds a sandbox's processes together (its cgroups), "" where nothing does
    unisolated: str = ""  # how the unisolated mode is contained here, "" where nothing could contain it


def call_limit_s(ctx: GraderContext, cases: int) -> float:
    """The most one call over `cases` samples may take, fixed when it starts: start-up, then the source's load and
    each sample at the wall limit, each with the runner's and this side's grace."""
    return START_S + (cases + 1) * (ctx.wall_s + KILL_GRACE_S + GRACE_S)


def _call_deadline(ctx: GraderContext, cases: int, caller: Deadline | None) -> Deadline:
    limit = call_limit_s(ctx, cases)
    what = (
        f"this call's limit of {limit:g} s (start-up, then loading the source and {cases} sample(s) at "
        f"{ctx.wall_s:g} s each)"
    )
    return earliest(Deadline.after(limit, what), caller)


@functools.lru_cache(maxsize=1)
def _found() -> tuple[cgroups.Pool | None, str, bool]:
    """What is cheap to know (no sandbox run): where sandboxes' cgroups are made (or None), why they cannot be
    isolated where that is known already, whether a pid namespace can be made."""
    pool = cgroups.find()
    bound = pool if isinstance(pool, cgroups.Pool) else None
    why = isolation.why_not_isolated()
    pid_ns = not why and _pid_namespace_works()
    return bound, why or ("" if bound else str(pool)), pid_ns


@functools.lru_cache(maxsize=1)
def _machine() -> tuple[SandboxStatus, Plan, Plan]:
    """This machine's status and how its sandboxes are made, isolated and not: checked once, the isolated way by
    running a trivial grader so (an async caller asks from a thread: it takes a sandbox's start-up)."""
    bound, why, pid_ns = _found()
    why = why or _probe(Plan(True, bound))
    contained = "a pid namespace of its own" if pid_ns else "a cgroup of its own" if bound else ""
    described = bound.describe() if bound else ""
    return SandboxStatus(not why, why, described, contained), Plan(True, bound), Plan(False, bound, pid_ns)


def _pid_namespace_works() -> bool:
    try:
        done = subprocess.run([*isolation.pid_namespace_command(), "true"], capture_output=True, timeout=10, env={})
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _probe(plan: Plan) -> str:
    """Why a trivial grader does not run isolated here, or "" where it does."""
    ctx = GraderContext()
    probe = blocking.run(session.run(isolation.PROBE_SOURCE, [(0, {}, {})], ctx, plan, _call_deadline(ctx, 1, None)))
    result = probe.results.get(0)
    if result is None or result.score != 1.0:
        return f"a trial sandbox failed ({probe.load_error or probe.ended or result})"
    if not probe.sealed:
        return "the sandbox's runner could not make itself non-dumpable (prctl through ctypes)"
    if not probe.filtered:
        return "the sandbox's runner could not load its system call filter (seccomp through prctl)"
    return ""


def status() -> SandboxStatus:
    """Whether this machine isolates python graders, and how they are bounded and contained."""
    return _machine()[0]


def start_refusal(ctx: GraderContext) -> str:
    """Why a service with this context must not start (python graders turned on where they would run with less
    than the operator's flags allow), or "". Probes the machine where they are on: call it at start, before the
    service starts other processes (under cgroup v2 it moves itself into a leaf of its cgroup)."""
    return refusal(ctx) if ctx.python_graders == "on" else ""


def describe(ctx: GraderContext) -> str:
    """What python graders get here, for the service's log at start. Cheap under "auto" (no trial sandbox: the first
    grader's call runs it)."""
    if ctx.python_graders == "off":
        return "python graders: off"
    bound, why, _ = _found()
    if ctx.python_graders == "auto" and why:
        return f"python graders: refused ({refusal(ctx, SandboxStatus(False, why))})"
    if ctx.python_graders == "on" and (why := refusal(ctx)):
        return f"python graders: refused ({why})"
    if ctx.python_graders == "on" and not status().isolated:
        return f"python graders: unisolated (the operator turned them on), contained by {status().unisolated}"
    way = "a uid of their own" if isolation.as_root() else "a user namespace of their own"
    trial = "" if ctx.python_graders == "on" else "; a trial sandbox at the first grader confirms it"
    return f"python graders: isolated ({way}), bounded by {bound and bound.describe()}, system calls filtered{trial}"


def refusal(ctx: GraderContext, found: SandboxStatus | None = None) -> str:
    """Why python graders may not run here (found: this machine's status, probed when not given), or "" where
    they may."""
    if ctx.python_graders == "off":
        return (
            f"python graders are turned off here ({ctx.command} --python-graders off); the operator allows them "
            "with --python-graders auto (isolated) or on"
        )
    found = found or status()
    if found.isolated:
        return ""
    if ctx.python_graders == "auto":
        return (
            f"python graders cannot be isolated on this machine ({found.why_not}); on a node that serves one "
            f"tenant the operator may accept that by turning them on explicitly ({ctx.command} --python-graders on "
            "--single-tenant)"
        )
    if not found.unisolated:
        return (
            f"python graders cannot run on this machine: they cannot be isolated ({found.why_not}) and nothing "
            "could end what a grader leaves running (neither a pid namespace nor a cgroup of its own can be made)"
        )
    if not ctx.single_tenant:
        return (
            f"python graders cannot be isolated on this machine ({found.why_not}); unisolated (--python-graders on) "
            "they run as the service's user, beside every tenant's work: the operator may allow that only on a "
            f"node that serves one tenant ({ctx.command} --python-graders on --single-tenant)"
        )
    return ""


async def check_source_async(source: str, ctx: GraderContext, deadline: Deadline | None = None) -> str:
    """Why the source does not load in the sandbox or defines no grade(), or "" where it does."""
    found = await asyncio.to_thread(status)
    limit = _call_deadline(ctx, 0, deadline)
    if limit.left() <= 0:
        return f"the source was not loaded: the graders before it used up {limit.what}"
    out = await _session(source, [], ctx, found.isolated, limit)
    return out.load_error or ("" if out.ready else f"the sandbox could not load it: {out.ended}")


def check_source(source: str, ctx: GraderContext) -> str:
    return blocking.run(check_source_async(source, ctx))


async def run_python_async(
    source: str, samples: list[dict[str, Any]], items: list[Any], ctx: GraderContext, deadline: Deadline | None = None
) -> list[GradeResult]:
    """grade(sample, item) for each pair, in as few sandbox processes as the grader's overruns allow, all within
    this call's limit (and `deadline`, where earlier)."""
    found = await asyncio.to_thread(status)
    why = refusal(ctx, found)
    if why:
        return [GradeResult(score=0.0, error=why, error_kind=SERVER) for _ in samples]
    limit = _call_deadline(ctx, len(samples), deadline)
    results: dict[int, GradeResult] = {}
    pending = list(range(len(samples)))
    while pending:
        if limit.left() <= 0:
            spent = f"not graded: the grader's earlier samples used up {limit.what}"
            results.update({i: GradeResult(score=0.0, error=spent, error_kind=UNRESPONSIVE) for i in pending})
            break
        out = await _session(source, [(i, samples[i], items[i]) for i in pending], ctx, found.isolated, limit)
        if out.load_error or not out.ready:
            error = out.load_error or f"the sandbox did not start: {out.ended}"
            kind = out.load_kind if out.load_error else out.kind
            results.update({i: GradeResult(score=0.0, error=error, error_kind=kind) for i in pending})
            break
        progressed = any(i in out.results for i in pending)
        results.update(out.results)
        pending = [i for i in pending if i not in results]
        if pending and (out.ended or not progressed):  # killed from here: the first not graded is the one it was on
            culprit = pending.pop(0)
            results[culprit] = GradeResult(score=0.0, error=out.ended or "the sandbox ended early", error_kind=out.kind)
    return [results[i] for i in range(len(samples))]


def run_python(source: str, samples: list[dict[str, Any]], items: list[Any], ctx: GraderContext) -> list[GradeResult]:
    return blocking.run(run_python_async(source, samples, items, ctx))


async def _session(
    source: str, cases: list[tuple[int, Any, Any]], ctx: GraderContext, isolated: bool, deadline: Deadline
) -> Outcome:
    """One sandbox process over `cases`, made as this machine makes them, isolated or not."""
    _, isolated_plan, unisolated_plan = await asyncio.to_thread(_machine)
    return await session.run(source, cases, ctx, isolated_plan if isolated else unisolated_plan, deadline)
