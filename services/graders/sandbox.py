"""Python graders, run in a sandbox process of their own, one process for a batch of samples, never in a service.

The process starts with an empty environment in a fresh scratch directory, isolated as services/graders/isolation.py
says where the machine allows it; samples and items go in as JSON on stdin, one JSON line per sample comes back on
stdout. A sample that overruns its wall clock (or CPU time) has the whole process group killed; the samples after
it get a new process. Every failure is reported for its sample (score 0), never raised."""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas.graders import GradeResult
from services.graders import isolation
from services.graders.context import GraderContext

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")
START_S = 10.0  # time to start the interpreter and load the source, beyond the wall limit
GRACE_S = 2.0  # beyond the per-sample wall limit before the process is killed from outside
LINE_MAX = 64 * 1024
SERVER, RUNTIME, UNRESPONSIVE = "python_grader_server_error", "python_grader_runtime_error", "unresponsive_reward_error"


@dataclass(frozen=True)
class SandboxStatus:
    isolated: bool
    why_not: str = ""  # why it is not, where it is not


@dataclass
class _Outcome:
    ready: bool | None = None  # None: the runner never said
    load_error: str = ""
    results: dict[int, GradeResult] = field(default_factory=dict)
    ended: str = ""  # why the process ended early, where it did
    kind: str = SERVER


@functools.lru_cache(maxsize=1)
def status() -> SandboxStatus:
    """Whether this machine isolates python graders: checked once, by running a trivial grader isolated."""
    why = isolation.why_not_isolated()
    if why:
        return SandboxStatus(False, why)
    probe = _session(isolation.PROBE_SOURCE, [(0, {}, {})], GraderContext(), isolated=True)
    result = probe.results.get(0)
    if result is None or result.score != 1.0:
        return SandboxStatus(False, f"a trial sandbox failed ({probe.load_error or probe.ended or result})")
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


def check_source(source: str, ctx: GraderContext) -> str:
    """Why the source does not load in the sandbox or defines no grade(), or "" where it does."""
    out = _session(source, [], ctx, isolated=status().isolated)
    return out.load_error or ("" if out.ready else f"the sandbox could not load it: {out.ended}")


def run_python(source: str, samples: list[dict[str, Any]], items: list[Any], ctx: GraderContext) -> list[GradeResult]:
    """grade(sample, item) for each pair, in as few sandbox processes as the graders' overruns allow."""
    why = refusal(ctx)
    if why:
        return [GradeResult(score=0.0, error=why, error_kind=SERVER) for _ in samples]
    results: dict[int, GradeResult] = {}
    pending = list(range(len(samples)))
    while pending:
        out = _session(source, [(i, samples[i], items[i]) for i in pending], ctx, isolated=status().isolated)
        if out.load_error or out.ready is None:
            error = out.load_error or f"the sandbox did not start: {out.ended}"
            kind = RUNTIME if out.load_error else out.kind
            results.update({i: GradeResult(score=0.0, error=error, error_kind=kind) for i in pending})
            break
        results.update(out.results)
        pending = [i for i in pending if i not in results]
        if pending:  # the first one not graded is the one the process ended on
            culprit = pending.pop(0)
            results[culprit] = GradeResult(score=0.0, error=out.ended or "the sandbox ended early", error_kind=out.kind)
    return [results[i] for i in range(len(samples))]


def _session(source: str, cases: list[tuple[int, Any, Any]], ctx: GraderContext, isolated: bool) -> _Outcome:
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
        limits = {"wall_s": ctx.wall_s, "cpu_s": ctx.cpu_s, "memory_mib": ctx.memory_mib}
        request = {"source": source, "cases": cases, "limits": limits | {"max_processes": ctx.max_processes}}
        with tempfile.TemporaryFile(dir=work) as stdin:
            stdin.write(msgspec.json.encode(request))
            stdin.seek(0)
            return _run(command, stdin, work, ctx)
    except (OSError, subprocess.SubprocessError) as e:
        return _Outcome(ended=f"the sandbox could not be started ({e})")
    finally:
        if uid is not None:
            isolation.give_uid(uid)
        shutil.rmtree(work, ignore_errors=True)


def _run(command: list[str], stdin, cwd: str, ctx: GraderContext) -> _Outcome:
    proc = subprocess.Popen(
        command,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={},
        cwd=cwd,
        start_new_session=True,
        close_fds=True,
    )
    out = _Outcome()
    try:
        _read(proc, out, ctx)
    finally:
        _kill(proc)
    if not out.ended and proc.returncode:
        out.ended, out.kind = _exit_reason(proc.returncode, ctx), RUNTIME
    return out


def _read(proc: subprocess.Popen, out: _Outcome, ctx: GraderContext) -> None:
    """Result lines into `out` until the process closes its output; killed when a sample overruns."""
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    buf, err = b"", b""
    deadline = time.monotonic() + ctx.wall_s + START_S
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            out.ended, out.kind = f"the grader ran past its wall-clock limit of {ctx.wall_s} s", UNRESPONSIVE
            return
        for key, _ in sel.select(left):
            data = os.read(key.fd, 65536)
            if not data:
                sel.unregister(key.fileobj)
            elif key.data == "err":
                err = (err + data)[-4096:]
            else:
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    _take(line, out)
                    deadline = time.monotonic() + ctx.wall_s + GRACE_S
                if len(buf) > LINE_MAX:
                    out.ended = f"the sandbox wrote a line over {LINE_MAX} bytes"
                    return
    if out.ready is None and err:
        out.ended = err.decode(errors="replace").strip().splitlines()[-1][:500]
    try:  # a grader may close its output and go on: it still has only until the deadline
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        out.ended, out.kind = f"the grader ran past its wall-clock limit of {ctx.wall_s} s", UNRESPONSIVE


def _take(line: bytes, out: _Outcome) -> None:
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return
    if not isinstance(obj, dict):
        return
    if "ready" in obj:
        out.ready, out.load_error = bool(obj["ready"]), str(obj.get("error") or "")
        return
    score, index = obj.get("score"), obj.get("i")
    if isinstance(index, int) and index not in out.results and isinstance(score, (int, float)):
        error, kind = str(obj.get("error") or ""), str(obj.get("kind") or "")
        out.results[index] = GradeResult(score=0.0 if error else float(score), error=error, error_kind=kind)


def _kill(proc: subprocess.Popen) -> None:
    """The whole process group; in the isolated case unshare's death kills the pid namespace with it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _exit_reason(code: int, ctx: GraderContext) -> str:
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    if sig == signal.SIGXCPU:
        return f"the grader used up the sandbox's CPU time ({ctx.cpu_s} s a sample)"
    if sig:
        name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
        return f"the grader's process was ended by {name}"
    return f"the grader ended its process (exit status {code})"
