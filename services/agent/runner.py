"""One job's trainer: its process (one per rank on several devices) in a process group of its own; read its
events, cancel, stop or pause it, and end it all when any rank dies."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from schemas import trainer_lease
from schemas.nodes import CPU_DEVICE
from schemas.events import RENDEZVOUS_ENV, Cancelled, Failed, Finished, TrainerEvent, TrainerSpec
from services.aio import cancel_and_wait
from services.procs import asks_held, die_with_parent, niced, write_pid_file

log = logging.getLogger(__name__)
STDERR_LINES = 3  # the last lines of stderr become the error when the trainer dies
STDERR_WAIT_S = 5.0  # how long an exited trainer's stderr is read on (a grandchild may hold it open)
RANKS_END_S = 30.0  # after rank 0 finished, how long the other ranks may take to exit before they are killed
DEFAULT_TRAINER = [sys.executable, "-m", "trainer"]
_decode = msgspec.json.Decoder(TrainerEvent)


class TrainerRun:
    """Runs `trainer_command JOB.json` and turns its stdout into events; ends with Finished, Failed or Cancelled.

    The trainer never outlives the run: it dies with the agent (parent-death signal) and with this coroutine."""

    decoder: msgspec.json.Decoder = _decode  # what its stdout's lines are
    stdin: int = asyncio.subprocess.DEVNULL  # a session's trainer reads its calls there

    def took(self, line: object) -> bool:
        """Whether a line that is not an event was this run's own to handle (a session's answers)."""
        return False

    def __init__(
        self,
        spec: TrainerSpec,
        workdir: Path,
        command: list[str],
        env: dict[str, str],
        ranks: int = 1,
        niceness: int = 0,
        lease_s: float = 0.0,
    ) -> None:
        self.spec, self.workdir, self.env, self.ranks = spec, workdir, env, ranks
        self.lease_s = lease_s  # 0: no lease (the trainer never waits for the agent)
        self.lease_from: float | None = None  # when the job's trainer lease was taken (monotonic): it counts from there
        self.lease = workdir.resolve() / "lease"  # the ranks start in the job directory: an absolute path
        self.command = niced(command, niceness)  # beside a serving engine: its threads win the CPU at once
        self.proc: asyncio.subprocess.Process | None = None  # rank 0: it speaks for the job
        self.others: list[asyncio.subprocess.Process] = []  # ranks 1..N-1
        self.cancelled = False
        self.rank_died: str | None = None
        self.final_read: Finished | Failed | None = None  # its end, once read (before its process has exited)
        self.said_more: Callable[[], None] = lambda: None  # told at each line it prints, its end's included
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)

    async def run(self, on_event: Callable[[object], Awaitable[None]]) -> Finished | Failed | Cancelled:
        self.workdir.mkdir(parents=True, exist_ok=True)
        spec_path = self.workdir / "job.json"
        spec_path.write_bytes(msgspec.json.encode(self.spec))
        root = str(Path(__file__).resolve().parents[2])  # so `-m trainer` finds the trainer package
        env = {
            **os.environ,
            **self.env,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
        if self.ranks > 1:
            env.update(rank_env(self.ranks, self.workdir))
        if self.lease_s:
            self.renew(self.lease_from)
            env[trainer_lease.ENV] = str(self.lease)
        if self.cancelled:  # before it started: nothing to start
            return Cancelled()
        self.proc = await self._start(spec_path, env, 0)
        if self.cancelled:  # while it was starting: the signal found no process
            self._signal(signal.SIGKILL)
        for sig, name in ((signal.SIGUSR1, "JETLORA_STOP"), (signal.SIGUSR2, "JETLORA_PAUSE")):
            if self.env.get(name) and name not in env:  # asked while it started: too late for its environment
                self._ask(sig, name)  # held until its handlers are in (asks_held)
        pid_file = write_pid_file(self.workdir, self.proc.pid)
        readers = [asyncio.create_task(self._read_stderr(self.proc, 0))]
        tasks = list(readers)
        try:
            for rank in range(1, self.ranks):
                self.others.append(await self._start(spec_path, env, rank))
                readers.append(asyncio.create_task(self._read_stderr(self.others[-1], rank)))
            tasks += readers[1:] + [
                asyncio.create_task(self._watch(proc, readers[rank], rank)) for rank, proc in enumerate(self.others, 1)
            ]
            final = await self._read_events(on_event)
            code = await self.proc.wait()
            await asyncio.wait([readers[0]], timeout=STDERR_WAIT_S)  # its last words, for the error
            if isinstance(final, Finished) and self.others:
                await self._others_end()
        finally:  # cancelled, or failed reading: nothing of the trainer is left running
            await self._end_all()
            await cancel_and_wait(tasks)
            pid_file.unlink(missing_ok=True)
        if self.cancelled:
            return Cancelled()
        if self.rank_died:
            return Failed(message=self.rank_died)
        if final is not None:
            return final
        tail = " | ".join(self.stderr_tail)
        return Failed(
            message=f"training process exited unexpectedly (exit code {code})" + (f": {tail}" if tail else "")
        )

    @property
    def _lead(self) -> asyncio.subprocess.Process:
        """Rank 0's process, once started."""
        assert self.proc is not None, "the trainer has not started"
        return self.proc

    async def _start(self, spec_path: Path, env: dict[str, str], rank: int) -> asyncio.subprocess.Process:
        """Rank 0 leads a new process group; the other ranks join it, so one signal reaches them all."""
        group = 0 if rank == 0 else self._lead.pid
        with asks_held():  # a pause before its handlers are in waits for them (it would end the rank)
            return await asyncio.create_subprocess_exec(
                *die_with_parent([*self.command, str(spec_path)], signal.SIGKILL),
                stdout=asyncio.subprocess.PIPE if rank == 0 else asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                stdin=self.stdin if rank == 0 else asyncio.subprocess.DEVNULL,
                cwd=self.workdir,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if self.ranks > 1 else env,
                limit=2**24,
                process_group=group,
            )

    async def _watch(self, proc: asyncio.subprocess.Process, stderr: asyncio.Task, rank: int) -> None:
        """A rank that dies takes the job with it: the rest would wait for it in their next collective."""
        code = await proc.wait()
        await asyncio.wait([stderr], timeout=STDERR_WAIT_S)
        if code != 0 and not self.cancelled and self.rank_died is None:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            tail = " | ".join(t for t in self.stderr_tail if t.startswith(f"[rank {rank}]")) if code > 0 else ""
            self.rank_died = (
                f"rank {rank} of {self.ranks} {how}, so the job's other ranks were ended"
                + (f": {tail}" if tail else "")
                + "; resubmit it, or resume it from its last checkpoint"
            )
            log.warning("job %s: %s", self.spec.job, self.rank_died)
            self._signal(signal.SIGKILL)

    async def _others_end(self) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self.others)), RANKS_END_S)
        except asyncio.TimeoutError:
            log.warning(
                "job %s: ranks 1-%d had not exited %.0f s after rank 0 finished; killing them",
                self.spec.job,
                self.ranks - 1,
                RANKS_END_S,
            )

    async def _end_all(self) -> None:
        if any(p.returncode is None for p in [self._lead, *self.others]):
            self._signal(signal.SIGKILL)
            for p in [self._lead, *self.others]:
                await p.wait()

    async def _read_events(self, on_event) -> Finished | Failed | None:
        """Pass the trainer's events on as they come; the final one (Finished or Failed) is returned."""
        final = None
        assert self._lead.stdout is not None  # rank 0's is a pipe
        async for line in self._lead.stdout:
            line = line.strip()
            if not line.startswith(b"{"):
                continue
            try:
                event = self.decoder.decode(line)
            except msgspec.DecodeError:
                log.debug("trainer printed a line that is not an event: %r", line[:200])
                continue
            ends = isinstance(event, (Finished, Failed))
            if ends:
                final = self.final_read = event
            self.said_more()  # before the line is passed on: a checkpoint's own line says nothing of it
            if not ends and not self.took(event):
                await on_event(event)
        return final

    async def _read_stderr(self, proc: asyncio.subprocess.Process, rank: int) -> None:
        assert proc.stderr is not None  # every rank's is a pipe
        async for line in proc.stderr:
            text = line.decode(errors="replace").rstrip()
            if text:
                self.stderr_tail.append(text if self.ranks == 1 else f"[rank {rank}] {text}")
                log.debug("trainer %s rank %d: %s", self.spec.job, rank, text)

    def renew(self, heard_at: float | None = None) -> None:
        """The agent was heard on the bus at `heard_at` (time.monotonic(); default now): the trainer may go on for
        lease_s from then."""
        if self.lease_s:
            start = time.monotonic() if heard_at is None else heard_at
            trainer_lease.write(str(self.lease), start + self.lease_s)

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

    def suspend(self) -> None:
        """Stop computing where it stands, every rank at once (memory stays held): a serving engine needs the device."""
        self._signal(signal.SIGSTOP)

    def go_on(self) -> None:
        self._signal(signal.SIGCONT)

    def _ask(self, sig: int, env: str) -> None:
        if self.proc is None:  # not started yet: it starts asked (trainer/signals.py)
            self.env[env] = "1"
        else:  # every rank: they agree at the end of each step to end after the same one
            for proc in [self.proc, *self.others]:
                if proc.returncode is None:
                    try:
                        os.kill(proc.pid, sig)
                    except ProcessLookupError:
                        pass

    def _signal(self, sig: int) -> None:
        """The whole process group: every rank, and their data loaders and compilers."""
        if any(p.returncode is None for p in [self.proc, *self.others] if p):
            try:
                os.killpg(self._lead.pid, sig)
            except ProcessLookupError:
                pass


def rank_env(ranks: int, workdir: Path) -> dict[str, str]:
    """What torch.distributed needs to gather a job's ranks on this node (each rank adds its RANK): they meet
    through a file in the job's directory, not a port picked here that another process could take before rank 0
    binds it."""
    rendezvous = workdir.resolve() / "rendezvous"  # the ranks start in the job directory: a relative path would miss
    rendezvous.unlink(missing_ok=True)  # a run before this one (paused, resumed) may have left it
    return {"WORLD_SIZE": str(ranks), RENDEZVOUS_ENV: str(rendezvous)}


def trainer_env(device: int, devices: list[int]) -> dict[str, str]:
    """The trainer's environment beyond the agent's: its devices, and a share of the node's cores per rank."""
    gpu = device != CPU_DEVICE
    env = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices)) if gpu else "",
    }
    if len(devices) > 1 and "OMP_NUM_THREADS" not in os.environ:  # ranks share the node's cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(devices)))
    return env
