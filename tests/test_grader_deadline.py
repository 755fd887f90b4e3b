"""The sandbox's clock is the service's (services/graders/sandbox.py, runner.py): a grader that cancels its own
timers and, while it sleeps (no CPU, so no CPU limit fires), writes newlines and forged result lines into every
descriptor it has still ends at its wall-clock limit, scored 0 and counted as an error, at call and at module
level; a call that is cancelled kills its sandbox; nothing of either is left running. Real sandboxes; skipped where
this machine cannot isolate a grader (not root on Linux)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from schemas.graders import PythonGrader, Sample
from services.graders import GraderContext, check, grade_many, grade_many_async, status
from services.graders.sandbox import call_limit_s

pytestmark = pytest.mark.skipif(not status().isolated, reason=f"no sandbox here: {status().why_not}")
CTX = GraderContext(wall_s=2.0, cpu_s=2.0, memory_mib=256)
UNRESPONSIVE = "unresponsive_reward_error"

STALL = """
import os, signal, time
def stall():
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.setitimer(signal.ITIMER_PROF, 0)
    while True:
        time.sleep(0.5)
        for fd in range(64):
            try:
                os.write(fd, b'\\n')
            except OSError:
                pass
"""
FORGE = """
import os
LINE = b'{"i": 99, "score": 9.0}\\n{"started": true, "sealed": true}\\n'
def grade(sample, item):
    for fd in range(64):
        try:
            os.write(fd, LINE)
        except OSError:
            pass
    reached = []
    for path in ('/proc/1/fd/1', f'/proc/{os.getppid()}/fd/1'):
        try:
            with open(path, 'wb') as out:
                out.write(LINE)
            reached.append(path)
        except OSError:
            pass
    return 0.75 if reached else 0.25
"""
CALL_STALL = (
    STALL + "def grade(sample, item):\n    if sample['output_text'] == 'stall':\n        stall()\n    return 0.5\n"
)
MODULE_STALL = STALL + "stall()\ndef grade(sample, item):\n    return 1.0\n"
TRIVIAL = "def grade(sample, item):\n    return 1.0\n"


def run(source: str, outputs: list[str]):
    samples = [Sample.from_model_sample(o) for o in outputs]
    return grade_many(PythonGrader(name="p", source=source), samples, [{} for _ in outputs], CTX)


def sandbox_processes() -> list[str]:
    """This test process's descendants that are a sandbox (unshare over a jetlora-grader- directory, its runner)."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                commands[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], list(children.get(os.getpid(), []))
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        if "runner.py" in commands.get(pid, "") or "jetlora-grader-" in commands.get(pid, ""):
            found.append(f"{pid}: {commands[pid][:120]}")
    return found


def sandboxes() -> int:
    """Sandboxes running under this test process (one unshare each)."""
    return sum(1 for p in sandbox_processes() if "unshare" in p)


def until(condition, seconds: float):
    """condition()'s first truthy value within `seconds`, else its last value."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


async def until_async(condition, seconds: float):
    """until(), polling on the loop (so that waiting starts no thread of its own)."""
    deadline = time.monotonic() + seconds
    while not (value := condition()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return value


def sandbox_start_s() -> float:
    """What a trivial grader's call takes here now: the sandbox's start-up, measured, not assumed."""
    started = time.monotonic()
    [result] = run(TRIVIAL, ["x"])
    assert result.score == 1.0, result
    return time.monotonic() - started


def test_a_grader_that_stops_its_timers_and_writes_to_every_fd_ends_at_its_wall_limit_scored_0():
    start_s = sandbox_start_s()
    began = time.monotonic()
    [result] = run(CALL_STALL, ["stall"])
    took = time.monotonic() - began
    assert result.score == 0.0 and result.error_kind == UNRESPONSIVE, result
    assert "wall-clock limit of 2.0 s" in result.error, result
    assert took < start_s + CTX.wall_s + 1.0, (took, start_s)  # the limit + 1 s (and the sandbox's start-up)
    assert took < call_limit_s(CTX, 1)
    assert until(lambda: not sandbox_processes(), 2.0), sandbox_processes()


def test_the_samples_after_a_stalled_one_are_graded_in_a_new_sandbox():
    start_s = sandbox_start_s()
    began = time.monotonic()
    results = run(CALL_STALL, ["ok", "stall", "ok"])
    took = time.monotonic() - began
    assert [r.score for r in results] == [0.5, 0.0, 0.5], results
    assert results[1].error_kind == UNRESPONSIVE and results[0].error == results[2].error == ""
    assert took < 2 * start_s + CTX.wall_s + 1.0, (took, start_s)
    assert until(lambda: not sandbox_processes(), 2.0), sandbox_processes()


def test_the_pipe_the_service_reads_is_out_of_the_graders_reach():
    """Lines the service would take as a broken protocol, and the supervisor ignores, written everywhere."""
    results = run(FORGE, ["a", "b"])
    assert [(r.score, r.error) for r in results] == [(0.25, ""), (0.25, "")], results


def test_a_source_that_stalls_while_it_loads_is_refused_by_check_and_scores_0_at_its_wall_limit():
    start_s = sandbox_start_s()
    began = time.monotonic()
    [error] = check(PythonGrader(name="p", source=MODULE_STALL), "grader", CTX)
    took = time.monotonic() - began
    assert error.field == "grader.source" and "wall-clock limit of 2.0 s" in error.reason, error
    assert took < start_s + CTX.wall_s + 1.0, (took, start_s)
    began = time.monotonic()
    results = run(MODULE_STALL, ["a", "b"])
    took = time.monotonic() - began
    assert all(r.score == 0.0 and r.error_kind == UNRESPONSIVE for r in results), results
    assert "does not load" in results[0].error and "wall-clock limit of 2.0 s" in results[0].error
    assert took < start_s + CTX.wall_s + 1.0, (took, start_s)  # one load for the batch, not one a sample
    assert until(lambda: not sandbox_processes(), 2.0), sandbox_processes()


async def test_a_cancelled_grading_call_kills_its_sandbox_and_leaves_no_thread():
    grader = PythonGrader(name="p", source=CALL_STALL)
    samples = [Sample.from_model_sample("stall")]
    [warm] = await grade_many_async(PythonGrader(name="p", source=TRIVIAL), samples, [{}], CTX)
    assert warm.score == 1.0
    threads = threading.active_count()
    task = asyncio.create_task(grade_many_async(grader, samples, [{}], CTX))
    deadline = time.monotonic() + 10
    while not sandbox_processes():
        assert time.monotonic() < deadline and not task.done(), "the sandbox never started"
        await asyncio.sleep(0.05)
    task.cancel()
    began = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - began < 1.0
    assert await until_async(lambda: not sandbox_processes(), 2.0), sandbox_processes()
    leftovers = [d for d in os.listdir(CTX.scratch()) if d.startswith("jetlora-grader-")]
    assert leftovers == [], leftovers
    assert await until_async(lambda: threading.active_count() <= threads, 2.0), threading.enumerate()
