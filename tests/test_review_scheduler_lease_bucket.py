"""Agents started before the trainer lease bucket exists (a fresh deployment whose agents come up before the
scheduler that makes the bucket, or JetStream not answering at the agent's start) still fence their trainers once
the bucket is there: each attempt that starts opens it again. Before, the agent tried once at start and ran every
attempt of its life unfenced: with a lease past the scheduler's window, a frozen agent's trainer computed beside the
job's next attempt on another node (which found no entry and started at once). Real nats-server, agents, trainers."""

from __future__ import annotations

import asyncio
import signal

from schemas import names
from schemas.jobs import Accepted
from services import bus
from services.scheduler.core import SchedulerConfig
from tests.conftest import start_stack, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs
from tests.test_stalled_agent_trainer import FROZEN_S, INTERVAL, LONG_LEASE_S, STRAY_CPU_S, TRAIN, _checkpointed
from tests.harness.trainers import Trainers, cpu_s, holder

NOT_OPENED = "trainer lease bucket"  # the agent's warning that it could not open it


async def test_agents_started_before_the_bucket_fence_their_trainers_once_it_exists(nc, services, agents, tiny_model):
    await nc.jetstream().delete_key_value(names.TRAINER_LEASES_KV)  # as before the scheduler's first start
    for node in ("n1", "n2"):
        agents.start(
            node,
            gpus=None,
            offer_cpu=True,
            trainer=None,
            interval=INTERVAL,
            extra=("--trainer-lease-s", str(LONG_LEASE_S)),
        )
    for node in ("n1", "n2"):
        await wait_for(lambda n=node: NOT_OPENED in agents.log(n), timeout=60, what=f"{node} found no lease bucket")
    await bus.ensure_resources(nc)  # what the scheduler does at its first start
    await start_stack(services, SchedulerConfig(co_train="off", heartbeat_interval=INTERVAL, misses=3))
    await wait_nodes(nc, 2, timeout=60)
    request = {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "accelerator": "cpu", "retries": 1}
    reply = await submit(nc, {**request, "train": TRAIN})
    assert isinstance(reply, Accepted), reply
    trainers = Trainers([agents.tmp / "n1", agents.tmp / "n2"], reply.job)
    stop = asyncio.Event()
    watching = asyncio.create_task(trainers.watch(stop))
    try:
        first = (await wait_for(lambda: _checkpointed(nc, reply.job), timeout=120, what="a stored checkpoint")).node
        assert cpu_s(trainers.pids[1]) is not None, "attempt 1's trainer is not running"
        held = await holder(nc, reply.job)
        agents.procs[first].send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(FROZEN_S)  # the fault itself
        finally:
            agents.procs[first].send_signal(signal.SIGCONT)
        done = await wait_state(nc, reply.job, ("succeeded", "failed", "cancelled"), timeout=120)
    finally:
        stop.set()
        await watching
    assert done.state == "succeeded" and done.attempt == 2 and done.node != first, done
    stray = trainers.computed(1, trainers.started[2])
    gap = trainers.started[2] - trainers.last_computed(1)
    print(f"attempt 2's trainer started {gap:.2f} s after attempt 1's last computed ({stray:.3f} s of CPU after)")
    assert stray < STRAY_CPU_S, f"attempt 1's trainer computed {stray:.2f} s of CPU after attempt 2's had started"
    assert gap > 0, f"attempt 1's trainer computed {-gap:.2f} s after attempt 2's had started"
    assert held is not None and (held.node, held.attempt) == (first, 1), f"attempt 1 on {first} did not hold: {held}"
