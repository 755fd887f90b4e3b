"""A pause asked of a trainer in its first moments, before Python has installed its handlers, waits for them
(services/procs.asks_held, trainer/signals.py) instead of ending the process by SIGUSR2's default action: bench/chaos.py
saw a 2-device job preempted as it started fail with "rank 1 of 2 was killed by signal 12". Real processes: the
child is started as the agent starts a trainer's rank, and asked to pause before it has run a line of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from services.procs import asks_held
from tests.conftest import ROOT

CHILD = (
    "import time\n"
    "time.sleep(0.5)  # as a trainer's imports take a while before its handlers are in\n"
    "from trainer.signals import Signals\n"
    "signals = Signals()\n"
    "print('paused' if signals.pause else 'not asked', flush=True)\n"
)


async def started(held: bool) -> asyncio.subprocess.Process:
    async def start():
        return await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, cwd=ROOT, stdout=asyncio.subprocess.PIPE, process_group=0
        )

    if not held:
        return await start()
    with asks_held():
        return await start()


async def test_a_pause_asked_before_the_handlers_are_in_is_seen_once_they_are():
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    proc = await started(held=True)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask  # this process's own mask is as it was
    os.kill(proc.pid, signal.SIGUSR2)  # at once: the child is still sleeping, its handlers not in
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert (proc.returncode, out.decode().strip()) == (0, "paused")


async def test_without_it_the_same_pause_ends_the_process():
    """What the agent did before: the child dies of the signal (the guard above is what saves it)."""
    proc = await started(held=False)
    os.kill(proc.pid, signal.SIGUSR2)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == -signal.SIGUSR2 and out == b""
