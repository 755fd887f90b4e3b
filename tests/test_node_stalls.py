"""A node agent frozen (SIGSTOP of its own pid: its trainer, in a process group of its own, is not stopped) past the
scheduler's heartbeat window, then continued: the trainer waits once the agent's lease lapses, the scheduler takes
the attempt back if the job still waits, or ends it there if the job went elsewhere or ended. Never two trainers
of one job computing at once, and no finished work thrown away."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from schemas.jobs import Accepted
from tests.conftest import STACK_CONFIG, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs

JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}
STEPS, HOLD_S = 20, 6.0  # 0.3 s a step
LEASE_S = 2 * STACK_CONFIG.heartbeat_interval  # the agents' default: two heartbeat intervals
FROZEN_S = 4 * STACK_CONFIG.window  # well past the window in which the scheduler gives a silent node up


def marks(path: Path, job: str) -> list[tuple[int, int, float, int]]:
    """(attempt, step, wall time, pid) of each step the job's trainers computed, in order."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        j, attempt, step, at, pid = line.split()
        if j == job:
            out.append((int(attempt), int(step), float(at), int(pid)))
    return out


def start(agents, node: str, log: Path):
    return agents.start(node, gpus="4096", hold_s=HOLD_S, env={"HOLD_LOG": str(log), "HOLD_STEPS": str(STEPS)})


async def running_a_while(nc, log: Path, **request) -> str:
    reply = await submit(nc, {**JOB, **request})
    assert isinstance(reply, Accepted), reply
    await wait_for(lambda: len(marks(log, reply.job)) >= 3, timeout=30, what="a few steps computed")
    return reply.job


async def frozen(proc, seconds: float) -> tuple[float, float]:
    """SIGSTOP the agent's own process for `seconds` (the fault itself), then SIGCONT; (stopped, continued) times."""
    proc.send_signal(signal.SIGSTOP)
    stopped = time.time()
    try:
        await asyncio.sleep(seconds)
    finally:
        proc.send_signal(signal.SIGCONT)
    return stopped, time.time()


def computed_while_frozen(steps, stopped: float, continued: float) -> list:
    """Steps computed after the lease (and the step under way) must have stopped the trainer, before it was let go."""
    step_s = HOLD_S / STEPS
    return [m for m in steps if stopped + LEASE_S + step_s + 0.3 < m[2] < continued]


async def test_a_frozen_agents_attempt_is_taken_back_when_it_comes_back(nc, stack, agents, tmp_path):
    """One node: the job waits for a device while its node is silent, so when the node answers again still running
    it, that attempt goes on (it used to finish, have its upload refused three times, and start over from step 0)."""
    log = tmp_path / "steps"
    start(agents, "n1", log)
    await wait_nodes(nc, 1)
    job = await running_a_while(nc, log, retries=1)
    stopped, continued = await frozen(agents.procs["n1"], FROZEN_S)
    done = await wait_state(nc, job, ("succeeded", "failed", "cancelled"), timeout=60)
    assert done.state == "succeeded" and done.attempt == 1, done
    steps = marks(log, job)
    assert {a for a, *_ in steps} == {1}, "a second attempt ran"
    assert [s for _, s, *_ in steps] == list(range(1, STEPS + 1))  # every step once: nothing thrown away
    assert not computed_while_frozen(steps, stopped, continued), "the trainer went on after the lease lapsed"


async def test_a_frozen_agents_attempt_is_ended_when_the_job_went_to_another_node(nc, stack, agents, tmp_path):
    log = tmp_path / "steps"
    start(agents, "n1", log)
    start(agents, "n2", log)
    await wait_nodes(nc, 2)
    job = await running_a_while(nc, log, retries=1)
    first = stack.core.jobs[job].status.node
    proc = agents.procs[first]
    proc.send_signal(signal.SIGSTOP)
    stopped = time.time()
    try:
        await wait_for(lambda: any(a == 2 for a, *_ in marks(log, job)), timeout=30, what="attempt 2 elsewhere")
    finally:
        proc.send_signal(signal.SIGCONT)
    continued = time.time()
    old_pid = next(pid for a, _, _, pid in marks(log, job) if a == 1)
    await wait_for(lambda: not _alive(old_pid), timeout=5, what="attempt 1's trainer to be ended")
    done = await wait_state(nc, job, ("succeeded", "failed", "cancelled"), timeout=60)
    assert done.state == "succeeded" and done.attempt == 2 and done.node != first, done
    steps = marks(log, job)
    one = [m for m in steps if m[0] == 1]
    two = [m for m in steps if m[0] == 2]
    assert one[-1][2] < two[0][2], "attempt 1 computed while attempt 2 did"
    assert not computed_while_frozen(one, stopped, continued)
    assert not [m for m in one if m[2] > continued + 0.05], "attempt 1 computed after its node came back"


async def test_a_frozen_agents_attempt_of_a_job_that_failed_meanwhile_is_ended(nc, stack, agents, tmp_path):
    log = tmp_path / "steps"
    start(agents, "n1", log)
    await wait_nodes(nc, 1)
    job = await running_a_while(nc, log, retries=0)
    pid = marks(log, job)[0][3]
    proc = agents.procs["n1"]
    proc.send_signal(signal.SIGSTOP)
    stopped = time.time()
    try:
        failed = await wait_state(nc, job, ("failed",), timeout=30)
    finally:
        proc.send_signal(signal.SIGCONT)
    continued = time.time()
    assert "stopped answering" in failed.message
    await wait_for(lambda: not _alive(pid), timeout=5, what="the failed job's trainer to be ended")
    assert not computed_while_frozen(marks(log, job), stopped, continued)
    assert not [m for m in marks(log, job) if m[2] > continued + 0.05], "it computed after it came back"
    assert (await wait_state(nc, job, ("failed",))).state == "failed"  # and the job stays failed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not computing: its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
