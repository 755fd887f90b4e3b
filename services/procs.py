"""Child processes that do not outlive the process that started them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path


def die_with_parent(command: list[str], sig: int = signal.SIGKILL) -> list[str]:
    """`command` started so that the kernel sends it `sig` when its parent dies, even by SIGKILL: through
    util-linux's `setpriv --pdeathsig`, which sets it and execs the command (same pid), rather than a preexec_fn,
    which CPython documents as unsafe in a process with threads. Without setpriv (not Linux, or a minimal image)
    the command runs as it is and is ended by the parent's own shutdown."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if setpriv is None:
        return list(command)
    return [setpriv, f"--pdeathsig={signal.Signals(sig).name.removeprefix('SIG')}", "--", *command]


ASKS = frozenset({signal.SIGUSR1, signal.SIGUSR2})  # stop and pause (trainer/signals.py)
_holds = threading.local()  # asks_held's holds under way in a thread, and its mask before the first


@contextlib.contextmanager
def asks_held():
    """A trainer started inside holds the stop and pause signals (blocked: pending, not acted on) until it has
    installed its handlers, which unblock them (trainer/signals.py). A pause asked in a rank's first milliseconds,
    before Python ran a line of it, otherwise ended it by the signal's default action: the job failed, its other
    ranks ended with it (bench/chaos.py, a 2-device job preempted as it started). The mask is the calling thread's,
    which the forked child inherits across exec; the agent's own is as it was once the process is started. A trainer
    command that never unblocks them never sees a stop or pause.

    Holds overlap: the spawn is awaited inside (asyncio connects the pipes after the fork), so another job's
    trainer can start meanwhile on the same loop. The mask is restored by the last hold out, to what it was before
    the first; each restoring its own `before` left it blocked whenever the first in was the first out."""
    depth = getattr(_holds, "depth", 0)
    if depth == 0:
        _holds.before = signal.pthread_sigmask(signal.SIG_BLOCK, ASKS)
    _holds.depth = depth + 1
    try:
        yield
    finally:
        _holds.depth -= 1
        if _holds.depth == 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, _holds.before)


def niced(command: list[str], niceness: int) -> list[str]:
    """`command` at a lower CPU priority (every thread it starts inherits it), through coreutils' `nice`."""
    nice = shutil.which("nice") if niceness else None
    return [nice, "-n", str(niceness), *command] if nice else list(command)


PID_FILE = "trainer.pid"


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (with its pid, it names one process); None if it is
    gone or only a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def write_pid_file(directory: Path, pid: int) -> Path:
    """Record a child we started, so an agent that restarts after a crash can find it."""
    path = directory / PID_FILE
    path.write_text(f"{pid} {start_time(pid) or ''}\n")
    return path


def end_leftovers(root: Path, timeout: float = 10.0) -> list[int]:
    """End the process groups recorded in pid files under `root` (one directory down) that still run: what an
    agent killed without its shutdown left behind. Pid files of processes that are gone are removed too."""
    ended = []
    for path in root.glob(f"*/{PID_FILE}"):
        try:
            pid_text, _, started = path.read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if started.strip() and start_time(pid) == started.strip():  # the same process, not a reused pid
            try:
                os.killpg(pid, signal.SIGKILL)  # its session: data loaders and compilers too
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while start_time(pid) is not None and time.monotonic() < deadline:
                time.sleep(0.02)
            ended.append(pid)
        path.unlink(missing_ok=True)
    return ended
