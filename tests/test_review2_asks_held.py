"""Review of 9b99cac: the agent starts each trainer rank with SIGUSR1/SIGUSR2 blocked in its loop thread's mask
(services/procs.asks_held), the child inheriting it across exec, and restores its own once the process is started.
The spawn is awaited inside the hold (asyncio connects the pipes after the fork), so the agent's loop runs other
work meanwhile, another job's trainer start among it. Two jobs' trainers started at once (two devices of a node
assigned in one heartbeat) must leave the agent's mask as it was: left blocked, every process the agent starts
after (an engine's restart command, a co-training group, a later trainer before its handlers) would start with the
stop and pause signals held. Real processes: the agent's TrainerRun with the stand-in trainer, which installs the
trainer's handlers (trainer/signals.py) and is stopped by SIGUSR1 once both run."""

from __future__ import annotations

import asyncio
import shlex
import signal
import threading

import pytest

from schemas.events import Finished, Progress, Started
from services.agent.runner import TrainerRun
from services.procs import ASKS
from tests.conftest import HOLD_TRAINER, spec_for, wait_for

pytestmark = pytest.mark.timeout(120)


def _blocked(status: str) -> set[int]:
    """The signals a /proc/PID/status says are blocked (SigBlk, a hexadecimal mask: bit n-1 for signal n)."""
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


async def _a_later_childs_blocked_signals() -> set[int]:
    """What a process the agent's loop starts now, without asks_held (as an engine's restart command), holds."""
    proc = await asyncio.create_subprocess_exec("cat", "/proc/self/status", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return _blocked(out.decode())


async def test_two_trainers_started_at_once_leave_the_agents_mask_as_it_was(tmp_path):
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert not mask & ASKS, mask  # this process, as the agent, acts on neither (nor blocks them)
    runs = [
        TrainerRun(
            spec_for("/models/tiny", tmp_path / f"j{i}"),
            tmp_path / f"j{i}",
            shlex.split(HOLD_TRAINER),
            {"HOLD_S": "60", "HOLD_STEPS": "600"},
        )  # fmt: skip
        for i in range(2)
    ]
    events: list[object] = []

    async def on_event(ev: object) -> None:
        events.append(ev)

    ran = [asyncio.create_task(r.run(on_event)) for r in runs]  # started in the same turn of the loop
    try:
        await wait_for(lambda: all(r.proc is not None for r in runs), timeout=30, what="both trainers started")
        after, later = signal.pthread_sigmask(signal.SIG_BLOCK, []), await _a_later_childs_blocked_signals()
        await wait_for(lambda: len([e for e in events if isinstance(e, Started)]) == 2, timeout=30,
                       what="both trainers past their handlers' install (Started)")  # fmt: skip
        for r in runs:  # a stop reaches each
            r.stop()
        ended = await asyncio.wait_for(asyncio.gather(*ran), 60)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # the next tests run as they would have
        for r in runs:
            r.cancel()
        await asyncio.gather(*ran, return_exceptions=True)
    assert [(type(e).__name__, getattr(e, "state", None)) for e in ended] == [("Finished", "stopped")] * 2, ended
    assert all(isinstance(e, Finished) for e in ended)
    assert after == mask, f"the agent's mask after two trainer starts at once: {sorted(after)}, before {sorted(mask)}"
    assert not later & set(ASKS), f"a process started after them holds {sorted(later & set(ASKS))} blocked"


def _children() -> set[int]:
    """This thread's child processes (the loop's: asyncio forks its subprocesses in the loop's thread)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/children") as f:
        return {int(p) for p in f.read().split()}


@pytest.mark.parametrize("ask", ["pause", "stop"])
async def test_a_pause_or_stop_asked_while_the_trainer_starts_is_not_lost(tmp_path, ask):
    """The agent asks for a pause (a preemption, a serving engine, a silent client) or a stop in the turns of its loop
    between the trainer's fork and the end of its spawn (its pipes being connected): the process exists, its
    handlers are not in, and TrainerRun.proc is not set yet. Before, the ask went to the environment of a process
    already started (it never saw it) and no signal was sent: the trainer trained on to its end, as if not asked."""
    before = _children()
    run = TrainerRun(spec_for("/models/tiny", tmp_path), tmp_path / "job", shlex.split(HOLD_TRAINER),
                     {"HOLD_S": "20", "HOLD_STEPS": "200"})  # fmt: skip
    events: list[object] = []

    async def on_event(ev: object) -> None:
        events.append(ev)

    ran = asyncio.create_task(run.run(on_event))
    try:
        for _ in range(100):  # the loop's turns, one at a time, until the fork: the spawn is still awaited then
            await asyncio.sleep(0)
            if _children() - before:
                break
        assert _children() - before and run.proc is None, "the trainer's spawn was not caught between fork and end"
        getattr(run, ask)()  # as the agent's control handler asks it (services/agent/service.py)
        final = await asyncio.wait_for(ran, 60)
    finally:
        run.cancel()
        await asyncio.gather(ran, return_exceptions=True)
    assert isinstance(final, Finished) and final.state == {"pause": "paused", "stop": "stopped"}[ask], final
    assert final.step < 200 and all(e.step < 200 for e in events if isinstance(e, Progress)), "trained to its end"


async def test_a_spawn_that_fails_or_is_cancelled_inside_the_hold_leaves_the_mask_as_it_was(tmp_path):
    """A trainer command that cannot be started (raises at the fork) and a start cancelled while its pipes are
    connected (the job cancelled as it starts), each beside a hold of another start under way."""
    from services.procs import asks_held

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])

    async def spawn(command: list[str]) -> asyncio.subprocess.Process:
        with asks_held():
            return await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)

    try:
        ok = asyncio.create_task(spawn(["true"]))
        await asyncio.sleep(0)  # forked; its pipes not yet connected: its hold is under way
        with pytest.raises(FileNotFoundError):
            await spawn([str(tmp_path / "no-such-trainer")])
        cancelled = asyncio.create_task(spawn(["true"]))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        proc = await ok
        await proc.communicate()
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
