"""Python graders, run in a sandbox process of their own, one process for a batch of samples, never in a service.

The process starts with an empty environment in a fresh scratch directory, isolated as services/graders/isolation.py
says where the machine allows it; samples and items go in as JSON on stdin. Its runner (runner.py) forks the grader
into a worker that never holds the results pipe, times the load and each sample from outside the grader's process,
and alone writes the lines read here: a start line, a ready line, then one line per sample, in order.

Time is fixed at the start of each call: call_limit_s (start-up, the load and every sample at the wall limit, each
with grace), earlier still where the caller's own deadline (a request's sandbox time) is; each line must come within
the wall limit (and grace) of the one before, and only the line expected next counts. Past either, the whole process
group is killed from here. A sample that overruns or kills its worker is reported for that sample and the samples
after it get a new process. A call that is cancelled kills its sandbox before it returns. Every failure is reported
for its sample (score 0), never raised."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas.graders import GradeResult
from services.graders import blocking, isolation
from services.graders.context import GraderContext
from services.graders.deadline import Deadline, earliest

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")
KILL_GRACE_S = 0.5  # past a sample's wall limit before the runner kills its worker
START_S = 10.0  # to start the sandbox and its interpreter, up to the runner's first line
GRACE_S = 2.0  # past the runner's own kill of an overrunning worker, before the whole sandbox is killed from here
LINE_MAX = 64 * 1024
ERR_KEPT = 4096  # the tail of the sandbox's stderr kept, for a sandbox that fails before its runner speaks
SERVER, RUNTIME, UNRESPONSIVE = "python_grader_server_error", "python_grader_runtime_error", "unresponsive_reward_error"


@dataclass(frozen=True)
class SandboxStatus:
    isolated: bool
    why_not: str = ""  # why it is not, where it is not


@dataclass
class _Outcome:
    order: list[int] = field(default_factory=list)  # the cases' indices, in the order their lines must come
    started: bool = False
    sealed: bool = False  # the runner made itself non-dumpable: the grader cannot reach the results pipe
    ready: bool | None = None  # None: the runner never said
    load_error: str = ""
    load_kind: str = RUNTIME
    results: dict[int, GradeResult] = field(default_factory=dict)
    ended: str = ""  # why the process ended early, where it did
    kind: str = SERVER


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
def status() -> SandboxStatus:
    """Whether this machine isolates python graders: checked once, by running a trivial grader isolated (an async
    caller asks from a thread: the first call takes a sandbox's start-up)."""
    why = isolation.why_not_isolated()
    if why:
        return SandboxStatus(False, why)
    probe = blocking.run(
        _session(isolation.PROBE_SOURCE, [(0, {}, {})], GraderContext(), True, _call_deadline(GraderContext(), 1, None))
    )
    result = probe.results.get(0)
    if result is None or result.score != 1.0:
        return SandboxStatus(False, f"a trial sandbox failed ({probe.load_error or probe.ended or result})")
    if not probe.sealed:
        return SandboxStatus(False, "the sandbox's runner could not make itself non-dumpable (prctl through ctypes)")
    return SandboxStatus(True)


def refusal(ctx: GraderContext, found: SandboxStatus | None = None) -> str:
    """Why python graders may not run here (found: this machine's status, probed when not given), or "" where
    they may."""
    if ctx.python_graders == "off":
        return (
            f"python graders are turned off here ({ctx.command} --python-graders off); the operator allows them "
            "with --python-graders auto (isolated) or on"
        )
    found = found or status()
    if ctx.python_graders == "auto" and not found.isolated:
        return (
            f"python graders cannot be isolated on this machine ({found.why_not}); the operator may accept "
            f"that by turning them on explicitly ({ctx.command} --python-graders on)"
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
) -> _Outcome:
    """One sandbox process over `cases`, in a scratch directory removed afterwards."""
    work = tempfile.mkdtemp(prefix="jetlora-grader-", dir=ctx.scratch())
    uid = isolation.take_uid() if isolated else None
    try:
        home = os.path.join(work, "home")
        os.mkdir(home, 0o700)
        shutil.copyfile(RUNNER, os.path.join(home, "runner.py"))
        os.chmod(os.path.join(home, "runner.py"), 0o644)
        if uid is not None:
            root = os.path.join(work, "root")
            os.mkdir(root, 0o755)
            command = isolation.isolated_command(root, home, uid, ctx, len(cases))
        else:
            command = isolation.fallback_command(home, ctx, len(cases))
        limits = {"wall_s": ctx.wall_s, "cpu_s": ctx.cpu_s, "memory_mib": ctx.memory_mib, "kill_grace_s": KILL_GRACE_S}
        request = {"source": source, "cases": cases, "limits": limits | {"max_processes": ctx.max_processes}}
        with tempfile.TemporaryFile(dir=work) as stdin:
            stdin.write(msgspec.json.encode(request))
            stdin.seek(0)
            return await _run(command, stdin, work, _Outcome(order=[c[0] for c in cases]), ctx, deadline)
    except (OSError, subprocess.SubprocessError) as e:
        return _Outcome(ended=f"the sandbox could not be started ({e})")
    finally:
        if uid is not None:
            isolation.give_uid(uid)
        shutil.rmtree(work, ignore_errors=True)


async def _run(command: list[str], stdin, cwd: str, out: _Outcome, ctx: GraderContext, deadline: Deadline) -> _Outcome:
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=stdin,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={},
        cwd=cwd,
        start_new_session=True,
        limit=LINE_MAX,
    )
    assert proc.stdout is not None and proc.stderr is not None
    err = asyncio.create_task(_tail(proc.stderr))
    try:
        await _read(proc, out, ctx, deadline)
    finally:  # also when the caller is cancelled: nothing of the sandbox outlives the call
        await _end(proc, err)
    if out.ready is None and not out.ended:
        text = err.result().decode(errors="replace").strip() if err.done() and not err.cancelled() else ""
        out.ended = (
            text.splitlines()[-1][:500] if text else f"it ended (status {proc.returncode}) before its runner spoke"
        )
    return out


async def _read(proc: asyncio.subprocess.Process, out: _Outcome, ctx: GraderContext, deadline: Deadline) -> None:
    """The runner's lines into `out` until it closes its output; the sandbox is killed (by the caller) when a line
    does not come in time."""
    assert proc.stdout is not None
    step = Deadline.after(START_S, f"the sandbox's start-up limit of {START_S:g} s")
    while True:
        until = earliest(step, deadline)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), max(0.0, until.left()))
        except TimeoutError:
            out.ended, out.kind = f"the grader ran past {until.what}", UNRESPONSIVE
            return
        except ValueError:  # a line over the stream's limit
            out.ended = f"the sandbox wrote a line over {LINE_MAX} bytes"
            return
        if not line:
            break
        if not _take(line, out):
            out.ended = f"the sandbox's runner broke its protocol (it wrote {line[:100]!r})"
            return
        step = Deadline.after(
            ctx.wall_s + KILL_GRACE_S + GRACE_S,
            f"its wall-clock limit of {ctx.wall_s:g} s (the sandbox stopped answering)",
        )
    until = earliest(step, deadline)
    try:  # the runner closed its output: its process ends now, within the same limits
        await asyncio.wait_for(proc.wait(), max(0.0, until.left()))
    except TimeoutError:
        out.ended, out.kind = f"the grader ran past {until.what}", UNRESPONSIVE


def _take(line: bytes, out: _Outcome) -> bool:
    """Whether the line is the one expected next (start, ready, then the next sample's result), taken into `out`."""
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return False
    if not isinstance(obj, dict):
        return False
    if not out.started:
        out.started, out.sealed = obj.get("started") is True, obj.get("sealed") is True
        return out.started
    if out.ready is None:
        if not isinstance(obj.get("ready"), bool):
            return False
        out.ready, out.load_error = obj["ready"], str(obj.get("error") or "")
        out.load_kind = UNRESPONSIVE if obj.get("kind") == UNRESPONSIVE else RUNTIME
        return True
    if len(out.results) >= len(out.order):
        return False
    expected, score = out.order[len(out.results)], obj.get("score")
    if obj.get("i") != expected or isinstance(score, bool) or not isinstance(score, (int, float)):
        return False
    error, kind = str(obj.get("error") or ""), str(obj.get("kind") or "")
    out.results[expected] = GradeResult(score=0.0 if error else float(score), error=error, error_kind=kind)
    return True


async def _tail(stream: asyncio.StreamReader) -> bytes:
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-ERR_KEPT:]
    return kept


async def _end(proc: asyncio.subprocess.Process, err: asyncio.Task) -> None:
    """The whole process group killed (in the isolated case the runner's death ends its pid namespace too), the
    process reaped, the stderr reader done."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        await proc.wait()
        await asyncio.wait_for(asyncio.shield(err), 1.0)
    except TimeoutError:  # something of the grader's still holds its stderr open: stop reading it
        err.cancel()
    finally:
        if not err.done():
            err.cancel()
