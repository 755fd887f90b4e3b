"""Nothing speaks for another and nothing runs that should not: forged events, orphaned trainers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import msgspec

from schemas import names
from schemas.events import StateChange
from schemas.jobs import Accepted, Rejected
from services.procs import start_time, write_pid_file
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import STACK_CONFIG, kv_keys, run_held_job, states_of, submit, wait_for, wait_nodes, wait_state

CFG = STACK_CONFIG


async def test_an_event_from_a_node_that_does_not_hold_the_job_changes_nothing(nc, stack, agents):
    job_id = await run_held_job(nc, agents, node="n1", hold_s=2.0)
    forged = StateChange(job=job_id, state="failed", node="n2", attempt=1, message="forged by n2", ts=time.time())
    await nc.jetstream().publish(
        names.job(job_id, "n2", names.ADMIN_TENANT).state, msgspec.json.encode(forged)
    )  # its own subject
    lying = StateChange(
        job=job_id, state="failed", node="n2", attempt=1, message="n2 claims n1's subject", ts=time.time()
    )
    await nc.jetstream().publish(
        names.job(job_id, "n1", names.ADMIN_TENANT).state, msgspec.json.encode(lying)
    )  # the body disagrees
    job = await wait_state(nc, job_id, ("succeeded", "failed"), timeout=30)
    assert job.state == "succeeded" and "forged" not in job.message and "claims" not in job.message, job.message
    states = await states_of(nc, job_id)
    assert [s.node for s in states if s.message.startswith(("forged", "n2"))] == ["n2", "n2"]  # kept, not applied


async def test_a_sigkilled_agents_trainer_is_gone_within_the_window(nc, stack, agents, tmp_path):
    job_id = await run_held_job(nc, agents, node="doomed", hold_s=120)
    pid_files = list((tmp_path / "doomed" / "jobs").glob("*/trainer.pid"))
    assert len(pid_files) == 1
    pid = int(pid_files[0].read_text().split()[0])
    assert start_time(pid) is not None
    t0 = time.monotonic()
    agents.kill("doomed")
    await wait_for(lambda: start_time(pid) is None, timeout=CFG.window + 2, what=f"trainer {pid} to die with its agent")
    print(f"trainer gone {time.monotonic() - t0:.2f}s after its agent's SIGKILL")
    await wait_state(nc, job_id, "failed", timeout=10)


async def test_an_agent_ends_the_trainers_a_previous_agent_left_before_it_offers_a_device(nc, stack, agents, tmp_path):
    left_dir = tmp_path / "n1" / "jobs" / "oldjob-1"
    left_dir.mkdir(parents=True)
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    write_pid_file(left_dir, leftover.pid)
    try:
        agents.start("n1", gpus="4096", interval=0.25)
        await wait_nodes(nc, 1)  # it offers its device only once the leftover is gone
        assert leftover.poll() is not None, "the leftover trainer still runs"
        assert not (left_dir / "trainer.pid").exists()
        assert "left running here" in agents.log("n1")
    finally:
        if leftover.poll() is None:
            leftover.kill()
        leftover.wait()


def keyed(key: str, **kw) -> dict:
    from tests.qa import pairs

    return {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), "idempotency_key": key, **kw}


async def request_keys(nc) -> list[str]:
    return [k for k in await kv_keys(nc) if k.startswith("request.")]


async def test_a_retried_submission_returns_the_first_job_and_stores_nothing_new(nc, services):
    sched, stop, task = await services.start(lambda c: Scheduler(c, CFG))
    await asyncio.wait_for(sched.leading.wait(), 10)
    first = await submit(nc, keyed("order-42"))
    assert isinstance(first, Accepted)
    again = await submit(nc, msgspec.json.encode(keyed("order-42")).replace(b", ", b",  "))  # other formatting
    assert again == first
    racing = await asyncio.gather(*(submit(nc, keyed("order-43")) for _ in range(10)))  # a burst of retries
    assert len({r.job for r in racing}) == 1
    assert len(await request_keys(nc)) == 2

    other = await submit(nc, keyed("order-42", label="something else"))
    assert isinstance(other, Rejected) and [e.field for e in other.errors] == ["idempotency_key"]
    assert first.job in other.errors[0].reason

    await services.stop(stop, task, hard=True)  # the key outlives the scheduler that took it
    sched2, *_ = await services.start(lambda c: Scheduler(c, CFG))
    await asyncio.wait_for(sched2.leading.wait(), 15)
    assert await submit(nc, keyed("order-42")) == first
    assert len(await request_keys(nc)) == 2


async def test_a_key_is_free_again_after_the_window(nc, services):
    sched, *_ = await services.start(
        lambda c: Scheduler(c, SchedulerConfig(co_train="off", heartbeat_interval=0.25, idempotency_window_s=0.5))
    )
    await asyncio.wait_for(sched.leading.wait(), 10)
    first = await submit(nc, keyed("nightly"))
    assert await submit(nc, keyed("nightly")) == first

    async def new_job():
        reply = await submit(nc, keyed("nightly"))
        return reply if reply != first else None

    later = await wait_for(new_job, timeout=10, what="the key to expire")
    assert isinstance(later, Accepted) and later.job != first.job
