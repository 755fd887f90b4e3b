"""One sandbox process over a list of cases: its scratch directory, its cgroup, its command (isolation.py), the
runner's lines read within the call's deadline, and its end, after which nothing of it runs.

The process starts with an empty environment in a fresh scratch directory, samples and items as JSON on stdin.
Its runner (runner.py) writes a start line, a ready line, then one line per sample, in order; only the line expected
next counts, and each must come within the wall limit (and grace) of the one before, and all before `deadline`.
Past either the sandbox is ended from here. Ending it kills every process in its cgroup (or, without one, its
process group; in a pid namespace the runner's death ends the rest), whatever session a grader's process started."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas.graders import GradeResult
from services.graders import cgroups, isolation
from services.graders.context import GraderContext
from services.graders.deadline import Deadline, earliest

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = [os.path.join(HERE, name) for name in ("runner.py", "worker.py", "syscalls.py")]  # what runs inside
KILL_GRACE_S = 0.5  # past a sample's wall limit before the runner kills its worker
START_S = 10.0  # to start the sandbox and its interpreter, up to the runner's first line
GRACE_S = 2.0  # past the runner's own kill of an overrunning worker, before the whole sandbox is killed from here
LINE_MAX = 64 * 1024
ERR_KEPT = 4096  # the tail of the sandbox's stderr (its set-up and runner; the grader has none) kept
KILL_ROUNDS = 200  # cgroup kills, 5 ms apart, before its processes are left to the kernel
SERVER, RUNTIME, UNRESPONSIVE = "python_grader_server_error", "python_grader_runtime_error", "unresponsive_reward_error"


@dataclass(frozen=True)
class Plan:
    """How sandboxes are made here: isolated or not, in a cgroup of their own (where `pool` is), and, unisolated,
    in a pid namespace of their own."""

    isolated: bool
    pool: cgroups.Pool | None = None
    pid_namespace: bool = False


@dataclass
class Outcome:
    order: list[int] = field(default_factory=list)  # the cases' indices, in the order their lines must come
    started: bool = False
    sealed: bool = False  # the runner made itself non-dumpable: the grader cannot reach the results pipe
    filtered: bool = False  # the runner loaded the system call filter before the grader
    ready: bool | None = None  # None: the runner never said
    load_error: str = ""
    load_kind: str = RUNTIME
    results: dict[int, GradeResult] = field(default_factory=dict)
    ended: str = ""  # why the process ended early, where it did
    kind: str = SERVER
    oom_kills: int = 0  # processes the kernel ended for the sandbox's memory limit


async def run(
    source: str, cases: list[tuple[int, Any, Any]], ctx: GraderContext, plan: Plan, deadline: Deadline
) -> Outcome:
    """One sandbox process over `cases`, in a scratch directory and a cgroup removed afterwards."""
    work = tempfile.mkdtemp(prefix="jetlora-grader-", dir=ctx.scratch())
    uid = isolation.take_uid() if plan.isolated and isolation.as_root() else None
    group = None
    try:
        home = os.path.join(work, "home")
        os.mkdir(home, 0o700)
        for path in FILES:
            shutil.copyfile(path, os.path.join(home, os.path.basename(path)))
            os.chmod(os.path.join(home, os.path.basename(path)), 0o644)
        if plan.isolated:
            root = os.path.join(work, "root")
            os.mkdir(root, 0o755)
            command = isolation.isolated_command(root, home, uid, ctx)
        else:
            if not plan.pid_namespace:  # the grader sees this service's /proc: close its files there
                isolation.hide_service()
            command = isolation.unisolated_command(home, ctx, plan.pid_namespace)
        if plan.pool is not None:
            # one more process than the grader's: unshare's, waiting outside the namespaces
            group = plan.pool.make(cgroups.Limits(ctx.memory_mib, ctx.max_processes + 1, ctx.cpus))
            command = isolation.joined(group.procs_files(), command)
        limits = {"wall_s": ctx.wall_s, "cpu_s": ctx.cpu_s, "memory_mib": ctx.memory_mib, "kill_grace_s": KILL_GRACE_S}
        request = {"source": source, "cases": cases, "limits": limits | {"max_processes": ctx.max_processes}}
        with tempfile.TemporaryFile(dir=work) as stdin:
            stdin.write(msgspec.json.encode(request))
            stdin.seek(0)
            out = await _run(command, stdin, work, Outcome(order=[c[0] for c in cases]), ctx, deadline, group)
        return _with_memory(out, ctx)
    except (OSError, subprocess.SubprocessError) as e:
        return Outcome(ended=f"the sandbox could not be started ({e})")
    finally:
        if group is not None:
            group.remove()
        if uid is not None:
            isolation.give_uid(uid)
        shutil.rmtree(work, ignore_errors=True)


def _with_memory(out: Outcome, ctx: GraderContext) -> Outcome:
    """A sample whose process the kernel ended for the sandbox's memory limit says so. Whichever process the kernel
    picked, the runner's included (a grader in a user namespace may raise the runner's oom_score_adj: its /proc files
    are that namespace's root's), the sandbox's own memory made it: a sandbox that ended so is the grader's error."""
    if not out.oom_kills:
        return out
    said = f"the kernel ended it: the sandbox's processes together passed their {ctx.memory_mib} MiB"
    for i, r in out.results.items():
        if "SIGKILL" in r.error:
            out.results[i] = GradeResult(score=r.score, error=f"{r.error}; {said}", error_kind=r.error_kind)
    if out.ended or (out.ready is not False and len(out.results) < len(out.order)):
        out.ended = f"{out.ended}; {said}" if out.ended else f"the sandbox's runner ended early: {said}"
        out.kind = RUNTIME if out.kind == SERVER else out.kind
    return out


async def _run(
    command: list[str],
    stdin,
    cwd: str,
    out: Outcome,
    ctx: GraderContext,
    deadline: Deadline,
    group: cgroups.Cgroup | None,
) -> Outcome:
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
        await _end(proc, err, group, out)
    if out.ready is None and not out.ended:
        text = err.result().decode(errors="replace").strip() if err.done() and not err.cancelled() else ""
        out.ended = (
            text.splitlines()[-1][:500] if text else f"it ended (status {proc.returncode}) before its runner spoke"
        )
    return out


async def _read(proc: asyncio.subprocess.Process, out: Outcome, ctx: GraderContext, deadline: Deadline) -> None:
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


def _take(line: bytes, out: Outcome) -> bool:
    """Whether the line is the one expected next (start, ready, then the next sample's result), taken into `out`.
    The runner's lines are its own (the grader never holds this pipe), but are read as if they were not: anything
    unexpected is a broken protocol, never an exception."""
    try:
        obj = msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return False
    if not isinstance(obj, dict):
        return False
    if not out.started:
        out.started, out.sealed = obj.get("started") is True, obj.get("sealed") is True
        out.filtered = obj.get("filtered") is True
        return out.started
    if out.ready is None:
        if not isinstance(obj.get("ready"), bool):
            return False
        said = obj.get("error")
        out.ready, out.load_error = obj["ready"], said if isinstance(said, str) else ""
        out.load_kind = UNRESPONSIVE if obj.get("kind") == UNRESPONSIVE else RUNTIME
        return True
    if len(out.results) >= len(out.order):
        return False
    expected, score, error, kind = out.order[len(out.results)], obj.get("score"), obj.get("error"), obj.get("kind")
    if obj.get("i") != expected or isinstance(score, bool) or not isinstance(score, (int, float)):
        return False
    if not -sys.float_info.max <= score <= sys.float_info.max:  # compared, never converted: NaN and huge fail
        return False
    error, kind = error if isinstance(error, str) else "", kind if isinstance(kind, str) else ""
    out.results[expected] = GradeResult(score=0.0 if error else float(score), error=error, error_kind=kind)
    return True


async def _tail(stream: asyncio.StreamReader) -> bytes:
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-ERR_KEPT:]
    return kept


async def _end(proc: asyncio.subprocess.Process, err: asyncio.Task, group: cgroups.Cgroup | None, out: Outcome) -> None:
    """Every process of the sandbox killed (its cgroup's, whatever session they are in, else its process group),
    the process reaped, the cgroup's count of memory kills read and the cgroup removed, the stderr reader done."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        await _emptied(group)
        await proc.wait()
        if group is not None:
            out.oom_kills = group.oom_kills()
            await _emptied(group, remove=True)
        await asyncio.wait_for(asyncio.shield(err), 1.0)
    except TimeoutError:  # something of the grader's still holds its stderr open: stop reading it
        err.cancel()
    finally:
        if not err.done():
            err.cancel()


async def _emptied(group: cgroups.Cgroup | None, remove: bool = False) -> None:
    """Kill what is left in the cgroup until it is empty (and, with `remove`, gone), a few ms apart: a process
    being killed may fork once more, and leaves the cgroup only when the kernel has ended it."""
    if group is None:
        return
    for _ in range(KILL_ROUNDS):
        if not group.kill() and (not remove or group.remove()):
            return
        await asyncio.sleep(0.005)
