"""One trainer subprocess: start it in its own process group, read its events, cancel or stop it."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from schemas.events import Cancelled, Failed, Finished, TrainerEvent, TrainerSpec
from services.aio import cancel_and_wait
from services.procs import die_with_parent, write_pid_file

log = logging.getLogger(__name__)
STDERR_LINES = 3  # the last lines of stderr become the error when the trainer dies
DEFAULT_TRAINER = [sys.executable, "-m", "trainer"]
_decode = msgspec.json.Decoder(TrainerEvent)


class TrainerRun:
    """Runs `trainer_command JOB.json` and turns its stdout into events; ends with Finished, Failed or Cancelled.

    The trainer never outlives the run: it dies with the agent (parent-death signal) and with this coroutine."""

    def __init__(self, spec: TrainerSpec, workdir: Path, command: list[str], env: dict[str, str]) -> None:
        self.spec, self.workdir, self.command, self.env = spec, workdir, command, env
        self.proc: asyncio.subprocess.Process | None = None
        self.cancelled = False
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)

    async def run(self, on_event: Callable[[object], Awaitable[None]]) -> Finished | Failed | Cancelled:
        self.workdir.mkdir(parents=True, exist_ok=True)
        spec_path = self.workdir / "job.json"
        spec_path.write_bytes(msgspec.json.encode(self.spec))
        root = str(Path(__file__).resolve().parents[2])  # so `-m trainer` finds the trainer package
        env = {**os.environ, **self.env, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1"}
        self.proc = await asyncio.create_subprocess_exec(
            *self.command, str(spec_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL, cwd=self.workdir, env=env, start_new_session=True, limit=2**24,
            preexec_fn=die_with_parent(signal.SIGKILL))
        pid_file = write_pid_file(self.workdir, self.proc.pid)
        stderr_task = asyncio.create_task(self._read_stderr())
        try:
            final = await self._read_events(on_event)
            code = await self.proc.wait()
            await stderr_task
        finally:  # cancelled, or failed reading: nothing of the trainer is left running
            if self.proc.returncode is None:
                self._signal(signal.SIGKILL)
                await self.proc.wait()
            await cancel_and_wait([stderr_task])
            pid_file.unlink(missing_ok=True)
        if self.cancelled:
            return Cancelled()
        if final is not None:
            return final
        tail = " | ".join(self.stderr_tail)
        return Failed(message=f"training process exited unexpectedly (exit code {code})" + (f": {tail}" if tail else ""))

    async def _read_events(self, on_event) -> Finished | Failed | None:
        """Pass the trainer's events on as they come; the final one (Finished or Failed) is returned."""
        final = None
        async for line in self.proc.stdout:
            line = line.strip()
            if not line.startswith(b"{"):
                continue
            try:
                event = _decode.decode(line)
            except msgspec.DecodeError:
                log.debug("trainer printed a line that is not an event: %r", line[:200])
                continue
            if isinstance(event, (Finished, Failed)):
                final = event
            else:
                await on_event(event)
        return final

    async def _read_stderr(self) -> None:
        async for line in self.proc.stderr:
            text = line.decode(errors="replace").rstrip()
            if text:
                self.stderr_tail.append(text)
                log.debug("trainer %s: %s", self.spec.job, text)

    def cancel(self) -> None:
        """Kill the trainer's whole process group (its data loaders and compilers too)."""
        self.cancelled = True
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """Ask the trainer to save what it has learnt and end (it ends as `stopped`)."""
        self._ask(signal.SIGUSR1, "JETLORA_STOP")

    def pause(self) -> None:
        """Ask the trainer to save a checkpoint and end (it ends as `paused`)."""
        self._ask(signal.SIGUSR2, "JETLORA_PAUSE")

    def _ask(self, sig: int, env: str) -> None:
        if self.proc is None:  # not started yet: it starts asked (trainer/signals.py)
            self.env[env] = "1"
        else:
            self._signal(sig, group=False)

    def _signal(self, sig: int, group: bool = True) -> None:
        if self.proc and self.proc.returncode is None:
            try:
                if group:
                    os.killpg(self.proc.pid, sig)
                else:
                    os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
