"""A co-training group on this node: one trainer process (`python -m trainer.co_train`) holding a base model once
and training the adapters of several jobs on it. Each job's run holds a GroupMember, which the job's run drives as
it drives a trainer alone (runner.TrainerRun): run it to its end with its events passed on, cancel, stop or pause
it, renew its lease, stop it for a serving engine. Jobs join by a line on the process's stdin, with their base's
content digest (services/agent/models.py DIGESTS: the group's process lets in only its own base's); its stdout
carries each job's events, tagged with the job and the attempt (a superseded attempt's are dropped, and logged).

Yielding is per member: a member held for a serving engine sits out the group's steps (a line to the process); the
process is stopped (SIGSTOP) only while every member is held, and goes on (SIGCONT) as soon as one is not, so one
member's pause or an exempt member never lets another compute that must yield. The process dying fails every job
still in it, as a trainer's death fails its job; the last job leaving closes its stdin and the process ends.

A group of Tinker sessions (trainer/session/group.py) runs the same way; each session's calls go to the process as
MemberCall lines and come back as MemberAnswer lines (GroupedSession)."""

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
from schemas.co_train import SESSION
from schemas.events import Cancelled, Failed, Finished, GroupControl, GroupEvent, Requeue, TrainerSpec
from schemas.sessions import ANSWER_LINE, MemberAnswer, MemberCall, SessionCall
from services.agent.models import DIGESTS
from services.agent.session_run import TakesCalls
from services.aio import cancel_and_wait
from services.procs import PID_FILE, die_with_parent, niced, write_pid_file

log = logging.getLogger(__name__)
DEFAULT_GROUP_TRAINER = [sys.executable, "-m", "trainer.co_train"]
STDERR_LINES = 3
END_S = 30.0  # how long a group left by its last job may take to end its step and exit before it is killed
_decode = msgspec.json.Decoder(GroupEvent)
_answer = msgspec.json.Decoder(MemberAnswer)
_encode = msgspec.json.Encoder()


class GroupProcess:
    """One group's trainer process and the jobs in it, by job."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        command: list[str],
        env: dict[str, str],
        niceness: int = 0,
        lease_s: float = 0.0,
        on_empty: Callable[["GroupProcess"], None] = lambda _: None,
    ) -> None:
        self.name, self.workdir, self.env, self.lease_s = name, workdir, env, lease_s
        self.command = niced(command, niceness)
        self.on_empty = on_empty  # the agent forgets the group: a job placed in it from now on starts a new one
        self.lease = workdir.resolve() / "lease"
        self.lease_from: float | None = None  # when its first member's trainer lease was taken (monotonic)
        self.members: dict[str, GroupMember] = {}
        self.proc: asyncio.subprocess.Process | None = None
        self.closing = False  # its last job left: no job joins it any more
        self.tasks: list[asyncio.Task] = []
        self._starting = asyncio.Lock()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self.stopped = False  # SIGSTOPped: every member it holds must yield

    def member(self, spec: TrainerSpec) -> "GroupMember":
        """The job's part in the group: a Tinker session's takes calls (GroupedSession)."""
        return GroupedSession(self, spec) if spec.request.train.method == SESSION else GroupMember(self, spec)

    async def join(self, member: "GroupMember") -> None:
        """The job joins (its line sent, with its base's digest); the process is started for the first."""
        self.members[member.spec.job] = member  # before any await: the group is not empty while it joins
        spec = msgspec.structs.replace(member.spec, base_digest=await base_digest(member.spec.request.base_dir))
        async with self._starting:
            if self.proc is None:
                self.lease_from = member.lease_from
                await self._start()
        self.send(GroupControl(action="add", job=spec.job, spec=spec, attempt=spec.attempt))

    async def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        root = str(Path(__file__).resolve().parents[2])  # so `-m trainer.co_train` finds the trainer package
        env = {
            **os.environ,
            **self.env,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
        if self.lease_s:
            self.renew(self.lease_from)
            env[trainer_lease.ENV] = str(self.lease)
        self.proc = await asyncio.create_subprocess_exec(
            *die_with_parent(self.command, signal.SIGKILL),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.workdir,
            env=env,
            limit=2**24,
            process_group=0,
        )
        write_pid_file(self.workdir, self.proc.pid)
        stderr = asyncio.create_task(self._read_stderr(self.proc))
        self.tasks = [stderr, asyncio.create_task(self._read_events(self.proc, stderr))]

    def send(self, c: GroupControl) -> None:
        """A line to the process (buffered: a step under way never holds the agent's loop)."""
        proc = self.proc
        if proc is None or proc.returncode is not None or proc.stdin is None or proc.stdin.is_closing():
            return
        proc.stdin.write(_encode.encode(c) + b"\n")

    async def _read_events(self, proc: asyncio.subprocess.Process, stderr: asyncio.Task) -> None:
        """Each job's events to its member, as they come; once the process is gone, every job left in it fails."""
        assert proc.stdout is not None
        async for line in proc.stdout:
            if line.startswith(ANSWER_LINE):  # a session group's answer to one member's call
                self._answered(line)
                continue
            if not line.startswith(b"{"):
                continue
            try:
                ev = _decode.decode(line)
            except msgspec.DecodeError:
                log.debug("group %s printed a line that is not an event: %r", self.name, line[:200])
                continue
            member = self.members.get(ev.job)
            if member is not None and ev.attempt == member.spec.attempt:
                member.events.put_nowait(ev.event)
            else:
                log.info(
                    "group %s: dropped a %s event of job %s attempt %d (%s)",
                    self.name,
                    type(ev.event).__name__,
                    ev.job,
                    ev.attempt,
                    f"attempt {member.spec.attempt} runs now" if member else "no attempt of it runs here now",
                )
        code = await proc.wait()
        await asyncio.wait([stderr], timeout=5.0)
        tail = " | ".join(self.stderr_tail)
        for member in list(self.members.values()):
            member.events.put_nowait(
                Failed(
                    message=f"the co-training group's trainer process exited unexpectedly (exit code {code})"
                    + (f": {tail}" if tail else "")
                )
            )

    def _answered(self, line: bytes) -> None:
        try:
            answer = _answer.decode(line)
        except msgspec.DecodeError:
            log.warning("group %s printed an answer that does not decode: %r", self.name, line[:200])
            return
        member = self.members.get(answer.job)
        if isinstance(member, GroupedSession) and member.spec.attempt == answer.attempt:
            member.answered(answer.id, answer.reply)
        else:
            log.info("group %s: dropped an answer for job %s attempt %d", self.name, answer.job, answer.attempt)

    async def _read_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for line in proc.stderr:
            if text := line.decode(errors="replace").rstrip():
                self.stderr_tail.append(text)
                log.debug("group %s: %s", self.name, text)

    async def leave(self, member: "GroupMember") -> None:
        """The job is out of the group (ended, failed or cancelled); the last one out ends the process."""
        if self.members.get(member.spec.job) is member:
            del self.members[member.spec.job]
        if self.members or self.closing:
            self.settle()
            return
        self.closing = True
        self.settle()  # it must run to see its stdin close
        self.on_empty(self)
        proc = self.proc
        try:
            if proc is not None and proc.returncode is None:
                assert proc.stdin is not None
                proc.stdin.close()  # no job joins any more: it exits after the step under way
                await asyncio.wait_for(proc.wait(), END_S)
        except asyncio.TimeoutError:
            log.warning(
                "co-training group %s had not exited %.0fs after its last job left; killing it", self.name, END_S
            )
        finally:  # cancelled too: nothing of the group is left running
            self.signal(signal.SIGKILL)
            await cancel_and_wait(self.tasks)
            (self.workdir / PID_FILE).unlink(missing_ok=True)

    def renew(self, heard_at: float | None = None) -> None:
        if self.lease_s:
            start = time.monotonic() if heard_at is None else heard_at
            trainer_lease.write(str(self.lease), start + self.lease_s)

    def settle(self) -> None:
        """Stop the process while every member that joined is held (it yields for all of them), let it go on as
        soon as one is not (or it is closing): its state follows all its members', never one's alone."""
        joined = [m for m in self.members.values() if m.joined and not m.cancelled]
        stop = bool(joined) and all(m.held for m in joined) and not self.closing
        if stop != self.stopped:
            self.signal(signal.SIGSTOP if stop else signal.SIGCONT)
            self.stopped = stop

    def signal(self, sig: int) -> None:
        """The process's whole group (its data loaders and compilers too)."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


class GroupMember:
    """One job in a group, driven as a trainer alone is (runner.TrainerRun's interface)."""

    def __init__(self, group: GroupProcess, spec: TrainerSpec) -> None:
        self.group, self.spec = group, spec
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.joined = False
        self.held = False  # yielding to a serving engine: it sits out the group's steps
        self.asked: list[str] = []  # stop, pause or hold asked before it joined
        self.lease_from: float | None = None  # when the job's trainer lease was taken (monotonic)
        self.final_read: Finished | Failed | Cancelled | Requeue | None = None  # its end, once read

    @property
    def proc(self) -> asyncio.subprocess.Process | None:
        return self.group.proc if self.joined else None

    async def run(self, on_event: Callable[[object], Awaitable[None]]) -> Finished | Failed | Cancelled | Requeue:
        try:
            if self.cancelled:  # before it ran: it still leaves, so a group nobody joined is not left behind
                return Cancelled()
            await self.group.join(self)
            self.joined = True
            if self.cancelled:  # while it joined
                self._send("cancel")
            for action in self.asked:
                self._send(action)
            self.group.settle()
            while True:
                ev = await self.events.get()
                if isinstance(ev, (Finished, Failed, Cancelled, Requeue)):
                    self.final_read = ev
                    return ev
                await on_event(ev)
        except BaseException:
            self.cancel()  # this run was cancelled (or failed passing an event on): the job leaves the group now
            raise
        finally:
            await self.group.leave(self)

    def _send(self, action: str) -> None:
        self.group.send(GroupControl(action=action, job=self.spec.job, attempt=self.spec.attempt))  # type: ignore[arg-type]

    def cancel(self) -> None:
        """Drop the job from the group at once (its neighbours go on); the run ends as cancelled."""
        if not self.cancelled:
            self.cancelled = True
            if self.joined:
                self._send("cancel")
                self.group.settle()
            self.events.put_nowait(Cancelled())

    @property
    def left_unconfirmed(self) -> bool:
        """Cancelled out of a group whose process still runs: the process drops the job at its next step boundary
        (a step under way goes on computing it), and does not say when it did."""
        proc = self.group.proc
        return self.cancelled and self.joined and proc is not None and proc.returncode is None

    def stop(self) -> None:
        self._ask("stop")

    def pause(self) -> None:
        self._ask("pause")

    def _ask(self, action: str) -> None:
        if self.joined:
            self._send(action)
        else:
            self.asked.append(action)

    def renew(self, heard_at: float | None = None) -> None:
        self.group.renew(heard_at)

    def suspend(self) -> None:
        """A serving engine wants the device: this job sits out the group's steps from the next one (the process
        stops where it stands once every member is held)."""
        self._hold(True)

    def go_on(self) -> None:
        self._hold(False)

    def _hold(self, held: bool) -> None:
        self.held = held
        self._ask("hold" if held else "go")
        self.group.settle()


class GroupedSession(GroupMember, TakesCalls):
    """A training session in a session group (schemas/sessions.py says the words): driven as any member, and its calls (session_run.SessionDesk) go to the
    group's process as MemberCall lines, answered by number."""

    def __init__(self, group: GroupProcess, spec: TrainerSpec) -> None:
        super().__init__(group, spec)
        self._init_calls()

    async def run(self, on_event: Callable[[object], Awaitable[None]]) -> Finished | Failed | Cancelled | Requeue:
        try:
            return await super().run(on_event)
        finally:  # it left the group: the calls it never answered are tried again where the session goes on
            self.calls_end()

    def _stdin(self) -> asyncio.StreamWriter | None:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.returncode is not None or proc.stdin.is_closing():
            return None
        return proc.stdin

    def _line(self, number: int, call: SessionCall, call_id: str) -> bytes:
        line = MemberCall(job=self.spec.job, attempt=self.spec.attempt, id=number, call=call, call_id=call_id)
        return _encode.encode(line) + b"\n"

    @property
    def label(self) -> str:
        return f"{self.spec.job} (in co-training group {self.group.name})"


async def base_digest(base_dir: str) -> str:
    """The content digest of a joiner's base, from the agent's cache (hashed in a thread when a file is new or
    changed); "" when it cannot be read (the group's process then hashes it, or refuses the job, itself)."""
    try:
        return await asyncio.to_thread(DIGESTS.directory, base_dir)
    except (OSError, ValueError) as e:
        log.warning("base %s: its content digest could not be computed here (%s)", base_dir, e)
        return ""
