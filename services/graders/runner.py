"""Runs inside the sandbox (`python -I -S runner.py`, standard library only; never imported by a service), with
worker.py (the grader's side) and syscalls.py (the filter) beside it.

Two processes. The supervisor (this file's main; in the isolated sandbox the first process of its own pid namespace,
so nothing inside can signal it, and its exit ends every process there) reads {"source", "cases": [[i, sample,
item], ...], "limits"} as JSON on stdin, makes itself non-dumpable (so no process of the grader's uid can open its
/proc files or trace it), then forks the worker. The worker replaces its copies of the results pipe (stdout) and of
stderr with /dev/null before it compiles the grader's source, so the grader's code never holds a channel the service
reads: it can write only to the worker's own pipe to the supervisor.

The supervisor alone writes the service's lines, each checked and rebuilt by it: {"started", "sealed", "filtered"}
first, then {"ready", "error", "kind"} when the source has loaded (or failed to), then {"i", "score", "error",
"kind"} for each case in order. Its clock is the one that counts: the load and each case have `wall_s` (and the
grace `kill_grace_s`) from the moment the one before them ended, whatever the grader writes meanwhile; a case over
it, or a worker that dies, is reported for that case, the worker killed, and the supervisor exits (the service
starts a new sandbox for the cases left). What the worker sends is the grader's own word about its own samples,
taken only when it is the line expected next; the worker's interval timers only let a well-behaved overrun be
reported without a new process. Every line is read inside one guard and its numbers checked by comparison (never by
a function that raises): a line that is not JSON is ignored, one that cannot be read (nested too deep, a number too
long, not UTF-8) or that holds no finite score is the grader's own error for the sample it is on.

Before the worker exists the supervisor loads the system call filter (syscalls.py, beside it): it and every process
of the grader's run under it."""

import json
import os
import select
import signal
import sys
import time


def _siblings() -> tuple:
    """worker.py and syscalls.py, copied beside this file. Their directory is on the import path only for these
    imports: the grader may write into it later."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    try:
        import syscalls  # type: ignore[import-not-found]
        import worker  # type: ignore[import-not-found]

        return worker, syscalls
    finally:
        sys.path.remove(here)


worker, syscalls = _siblings()
RUNTIME, UNRESPONSIVE, KINDS = worker.RUNTIME, worker.UNRESPONSIVE, ("", worker.RUNTIME, worker.UNRESPONSIVE)
LINE_MAX = 64 * 1024  # the longest line the worker may send the supervisor
ERROR_MAX = 1000


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


def _filter() -> bool:
    """Load the system call filter; False where it could not be."""
    try:
        return syscalls.apply()
    except (OSError, AttributeError):
        return False


def _signal_name(sig: int) -> str:
    """SIGKILL, or "signal 40" for one Python has no name for (the real-time ones: Signals(40) raises)."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _exit_reason(status: int, limits: dict) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return f"the grader used up the sandbox's CPU time ({limits['cpu_s']} s a sample)"
        return f"the grader's process was ended by {_signal_name(sig)}"
    return f"the grader ended its process (exit status {os.waitstatus_to_exitcode(status)})"


class _Hostile(str):
    """Why a line from the worker could not be read: the grader's own error for the sample it is on."""


def _parse(line: bytes):
    """A line as JSON's object, None where it is not JSON (noise, ignored), or _Hostile where it is JSON this
    process will not hold."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    except RecursionError:
        return _Hostile("the grader wrote a line nested too deep to read into its result pipe")
    except Exception as e:  # noqa: BLE001 - a number too long, bytes that are not UTF-8, no memory: the grader's
        return _Hostile(f"the grader wrote a line that cannot be read into its result pipe ({type(e).__name__})")
    return obj if isinstance(obj, dict) else None


class _Worker:
    """The forked worker as the supervisor sees it: its lines, its exit."""

    def __init__(self, request: dict) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                worker.work(request, w)
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
        """The worker's next line as an object (None: not JSON; a _Hostile: JSON it cannot read), "timeout" past
        `deadline`, or "ended" once it has exited (or closed its pipe) with no whole line left; a line over LINE_MAX
        is "too long"."""
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
        return _parse(line)

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
        if isinstance(got, _Hostile):
            return None, got
        if got == "timeout":
            return None, "timeout"
        if got == "too long":
            worker.kill()
            return None, f"the grader wrote a line over {LINE_MAX} bytes into the sandbox's result pipe"
        if got == "ended":
            return None, worker.why_it_ended()
        # anything else is the grader's own noise: ignored, and it moves no clock


def _text(value) -> str:
    """An error the worker sent, where it is text, as text every JSON reader takes: a lone surrogate (which JSON
    escapes but UTF-8 cannot hold, so the service's reader refuses the line) replaced."""
    return value[:ERROR_MAX].encode("utf-8", "replace").decode() if isinstance(value, str) else ""


def _result(got: dict) -> tuple[float, str, str]:
    """A result line's (score, error, kind), checked by comparison; anything else about it the grader's error."""
    score, error, said = got.get("score"), _text(got.get("error")), got.get("kind")
    if not worker.finite(score):
        error = error or f"grade() returned {worker.shown(score)}; it must return a finite number"
    if not error and score is not None:  # finite: an int or a float a float holds
        return float(score), "", ""
    return 0.0, error, said if isinstance(said, str) and said in KINDS and said else RUNTIME


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
    loaded = ready.get("ready") is True
    _send(
        {
            "ready": loaded,
            "error": _text(ready.get("error")) or ("" if loaded else "the source does not load"),
            "kind": RUNTIME,
        }
    )
    if not loaded:
        return
    for i, _, _ in cases:
        got, why = _await(worker, lambda m, i=i: m.get("i") == i, limits)
        if isinstance(why, _Hostile):  # the grader's own error for this sample; its worker goes on to the next
            _send({"i": i, "score": 0.0, "error": str(why), "kind": RUNTIME})
            continue
        if got is None:
            worker.kill()
            if why == "timeout":
                why, kind = f"the grader ran past its wall-clock limit of {wall} for one sample", UNRESPONSIVE
            else:
                kind = RUNTIME
            _send({"i": i, "score": 0.0, "error": why, "kind": kind})
            return  # the service starts a new sandbox for the cases after this one
        score, error, kind = _result(got)
        _send({"i": i, "score": score, "error": error, "kind": kind})


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a pid namespace's first process: no signal from inside ends it
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    request = json.load(sys.stdin)
    sealed, filtered = _seal(), _filter()
    _send({"started": True, "sealed": sealed, "filtered": filtered})
    _supervise(request)


if __name__ == "__main__":
    main()
