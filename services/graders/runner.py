"""Runs inside the sandbox (`python -I -S runner.py`, standard library only; never imported by a service): reads
{"source", "cases": [[i, sample, item], ...], "limits"} as JSON on stdin, loads the grader's source, calls
`grade(sample, item)` for each case and writes one JSON line per case on stdout: {"i", "score"} or
{"i", "error", "kind"}. Each call has its own wall-clock and CPU budget (interval timers); the service outside
also kills the whole process when a case overruns, since a grader can catch anything this process raises."""

import json
import math
import os
import signal
import sys
import traceback

_MAIN = os.getpid()
RUNTIME, UNRESPONSIVE = "python_grader_runtime_error", "unresponsive_reward_error"


class Overrun(BaseException):
    """Raised into the grader when its case's wall-clock or CPU budget is spent."""


def _on_timer(signum, frame):
    raise Overrun("wall-clock" if signum == signal.SIGALRM else "CPU")


def _where(tb) -> str:
    lines = [f.lineno for f in traceback.extract_tb(tb) if f.filename == "<grader>"]
    return f" (line {lines[-1]})" if lines else ""


def _explain(e: BaseException, limits: dict) -> tuple[str, str]:
    """An exception from the grader as (error, kind), naming the limit it ran into."""
    if isinstance(e, Overrun):
        budget = limits["wall_s"] if str(e) == "wall-clock" else limits["cpu_s"]
        return f"the grader ran past its {e} limit of {budget} s for one sample", UNRESPONSIVE
    text = f"{type(e).__name__}: {e}"[:800] + _where(e.__traceback__)
    if isinstance(e, MemoryError):
        text += f"; the sandbox allows {limits['memory_mib']} MiB"
    elif isinstance(e, BlockingIOError) or (isinstance(e, OSError) and e.errno == 11):
        text += f"; the sandbox allows {limits['max_processes']} processes"
    elif isinstance(e, OSError) and e.errno in (101, 99, 111, 97):
        text += "; the sandbox has no network"
    return text, RUNTIME


def _score(value) -> tuple[float, str]:
    """A returned value as a score, or why it is none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, bool):
            return float(value), ""
        return 0.0, f"grade() returned {type(value).__name__} {str(value)[:80]!r}; it must return a number"
    value = float(value)
    if not math.isfinite(value):
        return 0.0, f"grade() returned {value}; it must return a finite number"
    return value, ""


def _timed(fn, args, limits):
    signal.setitimer(signal.ITIMER_REAL, limits["wall_s"])
    signal.setitimer(signal.ITIMER_PROF, limits["cpu_s"])
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_PROF, 0)


def _reap() -> None:
    """Collect children the grader left, so zombies do not count against its process limit."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _load(source: str, limits: dict):
    """The grader's grade function, or (None, why)."""
    scope = {"__name__": "grader"}
    try:
        _timed(exec, (compile(source, "<grader>", "exec"), scope), limits)
    except BaseException as e:  # noqa: BLE001 - anything the source does is the grader's error
        return None, "the source does not load: " + _explain(e, limits)[0]
    grade = scope.get("grade")
    if not callable(grade):
        return None, "the source defines no function grade(sample, item) -> float"
    return grade, ""


def main() -> None:
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    request = json.load(sys.stdin)
    out = os.dup(1)
    os.dup2(2, 1)  # what the grader prints goes to stderr, never into the results
    limits = request["limits"]
    signal.signal(signal.SIGALRM, _on_timer)
    signal.signal(signal.SIGPROF, _on_timer)

    def write(obj) -> None:
        if os.getpid() != _MAIN:  # a child the grader forked: it must not report, nor go on
            os._exit(0)
        os.write(out, (json.dumps(obj) + "\n").encode())

    grade, why = _load(request["source"], limits)
    write({"ready": grade is not None, "error": why})
    if grade is None:
        return
    for i, sample, item in request["cases"]:
        try:
            score, error = _score(_timed(grade, (sample, item), limits))
            kind = RUNTIME if error else ""
        except BaseException as e:  # noqa: BLE001
            if os.getpid() != _MAIN:
                os._exit(0)
            score, (error, kind) = 0.0, _explain(e, limits)
        _reap()
        write({"i": i, "score": score, "error": error, "kind": kind})


if __name__ == "__main__":
    main()
