"""A node agent frozen while its real trainer trains (SIGSTOP of the agent's own pid: the trainer, in a process group
of its own, is not stopped), a second node free, one retry allowed: the job's next attempt goes to the other node,
and its trainer starts only once the frozen node's trainer has stopped computing, whatever the frozen node's lease
is set to: its default (two heartbeat intervals, below the scheduler's window: the trainer stops by itself while its
agent is frozen), or longer than the window and the freeze (which the scheduler cannot know: the next attempt waits
in the trainer lease bucket until the frozen one is ended). Watched from outside: each trainer's CPU time, read
from /proc while it runs, and the steps each attempt reports."""

from __future__ import annotations

import asyncio
import signal
import time

import msgspec
import pytest

from schemas import names
from schemas.events import Progress
from schemas.jobs import Accepted
from services.scheduler.core import SchedulerConfig
from tests.conftest import get_job, start_stack, submit, wait_for, wait_nodes, wait_state
from tests.harness.trainers import Trainers, cpu_s
from tests.qa import pairs

INTERVAL = 0.25  # the scheduler's and the agents' heartbeats; 3 missed: the node is gone (0.75 s)
LONG_LEASE_S = 8.0  # past the scheduler's window and the freeze
FROZEN_S = 5.0
SETTLED_S = 0.5  # beyond its lease, what a trainer of a frozen agent may take to see it lapsed (a step under way)
# a progress event every 10 steps: the frozen agent's pipe from its trainer does not fill in the freeze, so a trainer
# with a long lease computes all through it (with one each step, it blocks writing its events after ~1.5 s)
TRAIN = {"max_steps": 800, "batch_size": 1, "max_seq_length": 64, "logging_steps": 10, "save_steps": 100}
STRAY_CPU_S = 0.1  # what a trainer that waits on its lease may use meanwhile (a few tiny-model steps' worth)


@pytest.mark.parametrize("lease_s", [None, LONG_LEASE_S], ids=["default-lease", "lease-past-the-window"])
async def test_a_frozen_agents_trainer_stops_before_the_next_attempts_starts(nc, services, agents, tiny_model, lease_s):
    await start_stack(services, SchedulerConfig(co_train="off", heartbeat_interval=INTERVAL, misses=3))
    extra = () if lease_s is None else ("--trainer-lease-s", str(lease_s))
    for node in ("n1", "n2"):
        agents.start(node, gpus=None, offer_cpu=True, trainer=None, interval=INTERVAL, extra=extra)
    await wait_nodes(nc, 2, timeout=60)
    steps: dict[str, list[int]] = {}  # node -> the steps its attempt reported, in order

    async def heard(msg) -> None:
        node = msg.subject.split(".")[-2]
        steps.setdefault(node, []).append(msgspec.json.decode(msg.data, type=Progress).step)

    sub = await nc.subscribe(names.job("*", "*").progress, cb=heard)
    request = {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "accelerator": "cpu", "retries": 1}
    reply = await submit(nc, {**request, "train": TRAIN})
    assert isinstance(reply, Accepted), reply
    trainers = Trainers([agents.tmp / "n1", agents.tmp / "n2"], reply.job)
    stop = asyncio.Event()
    watching = asyncio.create_task(trainers.watch(stop))
    try:
        first = (await wait_for(lambda: _checkpointed(nc, reply.job), timeout=120, what="a stored checkpoint")).node
        assert cpu_s(trainers.pids[1]) is not None, "attempt 1's trainer is not running"
        frozen = time.time()
        agents.procs[first].send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(FROZEN_S)  # the fault itself
        finally:
            agents.procs[first].send_signal(signal.SIGCONT)
        thawed = time.time()
        done = await wait_state(nc, reply.job, ("succeeded", "failed", "cancelled"), timeout=120)
    finally:
        stop.set()
        await watching
        await sub.unsubscribe()
    assert done.state == "succeeded" and done.attempt == 2 and done.node != first, done
    frozen_cpu = trainers.computed(1, frozen, thawed)
    if lease_s is None:  # its lease lapsed while its agent was frozen: it waited
        lapsed = frozen + 2 * INTERVAL + SETTLED_S
        late = trainers.computed(1, lapsed, thawed)
        assert late < STRAY_CPU_S, f"attempt 1's trainer computed {late:.2f} s of CPU past its lease, agent frozen"
    else:  # its lease outlasts the freeze: it trained on, alive, beside a frozen agent
        assert frozen_cpu > FROZEN_S / 4, (
            f"attempt 1's trainer computed {frozen_cpu:.2f} s of CPU while its agent was frozen"
        )
    stray = trainers.computed(1, trainers.started[2])
    gap = trainers.started[2] - trainers.last_computed(1)  # negative: both computed for that long
    print(
        f"lease {lease_s}: attempt 1 computed {frozen_cpu:.2f} s of CPU during the {FROZEN_S:.0f} s freeze; attempt 2's "
        f"trainer started {trainers.started[2] - frozen:.2f} s after the freeze began, {gap:.2f} s after attempt 1's "
        f"last computed ({stray:.3f} s of CPU after)"
    )
    assert stray < STRAY_CPU_S, f"attempt 1's trainer computed {stray:.2f} s of CPU after attempt 2's had started"
    assert gap > 0, f"attempt 1's trainer computed {-gap:.2f} s after attempt 2's had started"
    resumed = steps[done.node][0]
    assert resumed > TRAIN["save_steps"], f"attempt 2 started at step {resumed}, not from attempt 1's checkpoint"
    assert steps[done.node][-1] == TRAIN["max_steps"]


async def _checkpointed(nc, job: str):
    j = await get_job(nc, job)
    return j if "checkpoint at step" in j.message else None
