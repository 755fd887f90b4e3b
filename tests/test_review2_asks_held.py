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

import pytest

from schemas.events import Finished, Started
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
