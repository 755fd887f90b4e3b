"""Runs inside the sandbox, forked by runner.py: the worker, the grader's side (standard library only; never
imported by a service). It keeps nothing of the supervisor's but its own pipe to it, loads the grader's source,
calls grade(sample, item) for each case under interval timers, and writes one line per case.
Everything the grader's code can reach is here: what it writes is the grader's own word, which the supervisor
checks. The number checks (finite, shown) are shared with the supervisor: by comparison, never by a function that
raises."""

import json
import os
import resource
import signal
import sys
import traceback

RUNTIME, UNRESPONSIVE = "python_grader_runtime_error", "unresponsive_reward_error"
FLOAT_MAX = sys.float_info.max
_MAIN = os.getpid()  # the worker's pid, once forked: its children must not report


class Overrun(BaseException):
    """Raised into the grader when its case's wall-clock or CPU budget is spent."""


# --- the worker: loads the grader and calls it -------------------------------------------------------------------


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


def finite(value) -> bool:
    """A finite number (never a bool), checked by comparison: a NaN compares false, an integer too large for a float
    compares without being converted."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and -FLOAT_MAX <= value <= FLOAT_MAX


def shown(value) -> str:
    """A value as an error names it, never raising (an integer too long to print, a structure too deep)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -FLOAT_MAX <= value <= FLOAT_MAX:
        return f"an integer of {value.bit_length()} bits"
    try:
        return f"{type(value).__name__} {repr(value)[:80]}"
    except Exception:  # noqa: BLE001 - whatever its repr does
        return f"a {type(value).__name__}"


def _score(value) -> tuple[float, str]:
    """A returned value as a score, or why it is none."""
    if isinstance(value, bool):
        return float(value), ""
    if not isinstance(value, (int, float)):
        return 0.0, f"grade() returned {shown(value)}; it must return a number"
    if not finite(value):
        return 0.0, f"grade() returned {shown(value)}; it must return a finite number"
    return float(value), ""


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


def _cpu_limit(limits: dict, cases: int) -> None:
    """The worker's CPU for all its cases (and each process the grader forks, for its own), a backstop to the
    per-case timers; the runner has none (what the grader makes it spend reading must not end it)."""
    cpu = int(limits["cpu_s"] * max(cases, 1) + 5)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    cpu = cpu if hard == resource.RLIM_INFINITY else min(cpu, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))


def work(request: dict, channel: int) -> None:
    """The worker's life: nothing of the supervisor's but `channel` left open, then the grader. Its stdin, stdout
    and stderr are /dev/null: what the grader prints reaches no one (on the sandbox's stderr it made the service's
    process read as fast as the grader could write, a core outside the sandbox's CPU quota)."""
    global _MAIN
    _MAIN = os.getpid()
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):  # the results pipe (1) and the sandbox's stderr go, before any of the grader's code runs
        os.dup2(null, fd)
    os.closerange(3, channel)
    os.closerange(channel + 1, 1 << 16)
    limits = request["limits"]
    _cpu_limit(limits, len(request["cases"]))
    signal.signal(signal.SIGALRM, _on_timer)
    signal.signal(signal.SIGPROF, _on_timer)

    def write(obj) -> None:
        if os.getpid() != _MAIN:  # a child the grader forked: it must not report, nor go on
            os._exit(0)
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(channel, data) :]

    grade, why = _load(request["source"], limits)
    write({"ready": grade is not None, "error": why})
    if grade is None:
        os._exit(0)
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
    os._exit(0)
