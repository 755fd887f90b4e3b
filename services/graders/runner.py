"""Runs inside the sandbox (`python -I -S runner.py`, standard library only; never imported by a service).

Two processes. The supervisor (this file's main; in the isolated sandbox the first process of its own pid namespace,
so nothing inside can signal it, and its exit ends every process there) reads {"source", "cases": [[i, sample,
item], ...], "limits"} as JSON on stdin, makes itself non-dumpable (so no process of the grader's uid can open its
/proc files or trace it), then forks the worker. The worker replaces its copy of the results pipe (stdout) with
stderr before it compiles the grader's source, so the grader's code never holds the channel the service reads: it
can write only to the worker's own pipe to the supervisor.

The supervisor alone writes the service's lines, each checked and rebuilt by it: {"started", "sealed"} first, then
{"ready", "error", "kind"} when the source has loaded (or failed to), then {"i", "score", "error", "kind"} for each
case in order. Its clock is the one that counts: the load and each case have `wall_s` (and the grace
`kill_grace_s`) from the moment the one before them ended, whatever the grader writes meanwhile; a case over it, or
a worker that dies, is reported for that case, the worker killed, and the supervisor exits (the service starts a
new sandbox for the cases left). What the worker sends is the grader's own word about its own samples, taken only
when it is the line expected next; the worker's interval timers only let a well-behaved overrun be reported
without a new process."""

import json
import math
import os
import select
import signal
import sys
import time
import traceback

RUNTIME, UNRESPONSIVE = "python_grader_runtime_error", "unresponsive_reward_error"
KINDS = ("", RUNTIME, UNRESPONSIVE)
LINE_MAX = 64 * 1024  # the longest line the worker may send the supervisor
ERROR_MAX = 1000
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


def _work(request: dict, channel: int) -> None:
    """The worker's life: nothing of the supervisor's but `channel` (and stderr) left open, then the grader."""
    global _MAIN
    _MAIN = os.getpid()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)  # the results pipe goes here, before any of the grader's code runs; its prints go to stderr
    os.closerange(3, channel)
    os.closerange(channel + 1, 1 << 16)
    limits = request["limits"]
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


# --- the supervisor: times the worker and alone writes the results -------------------------------------------------


def _send(obj) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def _seal() -> bool:
    """Make this process non-dumpable (prctl PR_SET_DUMPABLE 0), so a process of the same uid cannot read its
    memory or open its file descriptors through /proc; the worker inherits it. False where it could not be done."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except (ImportError, OSError, AttributeError):
        return False


def _exit_reason(status: int, limits: dict) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return f"the grader used up the sandbox's CPU time ({limits['cpu_s']} s a sample)"
        name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
        return f"the grader's process was ended by {name}"
    return f"the grader ended its process (exit status {os.waitstatus_to_exitcode(status)})"


class _Worker:
    """The forked worker as the supervisor sees it: its lines, its exit."""

    def __init__(self, request: dict) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _work(request, w)
            finally:
                os._exit(1)
        os.close(w)
        self.pid, self.fd, self.buf = pid, r, b""
        self.status: int | None = None
        self.limits = request["limits"]

    def _reap(self) -> None:
        """Collect every exited child (orphans come to the first process of a pid namespace), noting the worker's."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pid:
                self.status = status

    def next(self, deadline: float):
        """The worker's next line as an object, "timeout" past `deadline`, or "ended" once it has exited (or closed
        its pipe) with no whole line left; a line over LINE_MAX is "too long"."""
        while b"\n" not in self.buf:
            self._reap()
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.1))
            if ready:
                data = os.read(self.fd, 65536)
                if not data:
                    return "ended"
                self.buf += data
                if len(self.buf) > LINE_MAX and b"\n" not in self.buf[:LINE_MAX]:
                    return "too long"
            elif self.status is not None:
                return "ended"  # exited; a child of its may still hold the pipe open
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def why_it_ended(self) -> str:
        self.kill()
        while self.status is None:
            try:
                _, self.status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                return "the grader's process ended"
        return _exit_reason(self.status, self.limits)


def _await(worker: _Worker, wanted, limits: dict) -> tuple[dict | None, str]:
    """The worker's next line that `wanted` accepts, within the wall limit from now; else (None, why, kind)."""
    deadline = time.monotonic() + limits["wall_s"] + limits["kill_grace_s"]
    while True:
        got = worker.next(deadline)
        if isinstance(got, dict) and wanted(got):
            return got, ""
        if got == "timeout":
            return None, "timeout"
        if got == "too long":
            worker.kill()
            return None, f"the grader wrote a line over {LINE_MAX} bytes into the sandbox's result pipe"
        if got == "ended":
            return None, worker.why_it_ended()
        # anything else is the grader's own noise: ignored, and it moves no clock


def _text(value) -> str:
    return str(value or "")[:ERROR_MAX]


def _supervise(request: dict) -> None:
    limits, cases = request["limits"], request["cases"]
    worker = _Worker(request)
    wall = f"{limits['wall_s']} s"
    ready, why = _await(worker, lambda m: "ready" in m, limits)
    if ready is None:
        worker.kill()
        if why == "timeout":
            _send(
                {
                    "ready": False,
                    "error": f"the source does not load: it ran past its wall-clock limit of {wall}",
                    "kind": UNRESPONSIVE,
                }
            )
        else:
            _send({"ready": False, "error": f"the source does not load: {why}", "kind": RUNTIME})
        return
    _send({"ready": bool(ready["ready"]), "error": _text(ready.get("error")), "kind": RUNTIME})
    if not ready["ready"]:
        return
    for i, _, _ in cases:
        got, why = _await(worker, lambda m, i=i: m.get("i") == i, limits)
        if got is None:
            worker.kill()
            if why == "timeout":
                why, kind = f"the grader ran past its wall-clock limit of {wall} for one sample", UNRESPONSIVE
            else:
                kind = RUNTIME
            _send({"i": i, "score": 0.0, "error": why, "kind": kind})
            return  # the service starts a new sandbox for the cases after this one
        score, error = got.get("score"), _text(got.get("error"))
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            score, error = 0.0, error or f"grade() returned {score!r}; it must return a finite number"
        said = got.get("kind")
        kind = said if isinstance(said, str) and said in KINDS else RUNTIME
        _send({"i": i, "score": 0.0 if error else float(score), "error": error, "kind": kind if error else ""})


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a pid namespace's first process: no signal from inside ends it
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    request = json.load(sys.stdin)
    sealed = _seal()
    _send({"started": True, "sealed": sealed})
    _supervise(request)


if __name__ == "__main__":
    main()
