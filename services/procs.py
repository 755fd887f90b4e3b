"""Child processes that do not outlive the process that started them."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL):
    """A preexec_fn for subprocess: the kernel sends the child `sig` when its parent dies, even by SIGKILL.

    Linux only (prctl); elsewhere it returns None and the child is ended by the parent's own shutdown."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def set_parent_death_signal() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return set_parent_death_signal


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
