"""One real jetlora service process behind its own proxy, and stalling a process (SIGSTOP, later SIGCONT)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from services.procs import die_with_parent, end_leftovers
from tests.harness.proxy import NatsProxy

ROOT = Path(__file__).resolve().parents[2]


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R running, S sleeping, T stopped, Z zombie...); None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


class Stall:
    """A process stopped by SIGSTOP, continued by SIGCONT after `seconds` (from a timer thread) or by resume():
    alive for the kernel, silent for everyone else, as a process paused by the OS, a debugger or swapping."""

    def __init__(self, pid: int, seconds: float):
        self.pid = pid
        self._lock = threading.Lock()
        self._done = threading.Event()
        os.kill(pid, signal.SIGSTOP)  # the service's own pid only: its trainers go on
        self._timer = threading.Timer(seconds, self.resume)
        self._timer.daemon = True
        self._timer.start()

    @property
    def done(self) -> bool:
        """Whether the process was continued."""
        return self._done.is_set()

    def resume(self) -> None:
        """Continue the process now (once; a later call, or the timer's, does nothing)."""
        with self._lock:
            if self._done.is_set():
                return
            self._timer.cancel()
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block this thread until the process was continued."""
        return self._done.wait(timeout)

    async def wait_async(self) -> None:
        """Until the process was continued, without blocking the loop."""
        while not self._done.is_set():
            await asyncio.sleep(0.02)


@dataclass
class Service:
    """A `python -m services.cli <kind>` process: its command line (kept for restarts), environment, log file,
    its own proxy to NATS, and the process now running (if any)."""

    name: str
    kind: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    proxy: NatsProxy
    work_dir: Path | None = None
    proc: subprocess.Popen | None = None

    def spawn(self) -> subprocess.Popen:
        """Start the command (again); stdout and stderr are appended to the log file. The kernel kills it if the
        thread that started it ends (setpriv --pdeathsig): start services from a long-lived thread."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                die_with_parent(self.command, signal.SIGKILL),
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self.proc

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash would; then what an agent leaves behind (its trainers' process groups) goes too."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        self.end_leftovers()

    def end_leftovers(self) -> None:
        if self.work_dir is not None and (self.work_dir / "jobs").is_dir():
            end_leftovers(self.work_dir / "jobs")

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait for the exit code (SIGCONT first, in case it is stalled)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)
        return self.proc.wait(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
