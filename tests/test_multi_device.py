"""Jobs on several devices of a node (real nats-server, agents as processes): placed whole or not at all, a waiting
one keeps its node while small jobs flow elsewhere, the real trainer as 2 ranks (gloo, on CPU) takes the steps one
process takes on twice the batch, through a pause and resume, and one rank's death ends the job and every rank."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from schemas import names
from schemas.events import Progress
from schemas.jobs import Accepted, Rejected
from schemas.job_status import JobQuery, JobReply
from services import bus
from services.procs import start_time
from tests.conftest import STACK_CONFIG, at_step, get_job, stream_events, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs


def held_job(**request) -> dict:
    return {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), **request}


async def cancel(nc, job: str) -> None:
    await bus.request(nc, names.CANCEL, JobQuery(job), JobReply)


async def test_a_job_on_several_devices_is_refused_when_no_node_has_that_many(stack, nc, agents):
    agents.start("n1", gpus="4096,4096")
    await wait_nodes(nc, 1)
    reply = await submit(nc, held_job(devices=3))
    assert isinstance(reply, Rejected) and reply.errors[0].field == "devices", reply
    assert "n1 has 2" in reply.errors[0].reason, reply
    reply = await submit(nc, held_job(devices=2, accelerator="cpu"))
    assert isinstance(reply, Rejected) and reply.errors[0].field == "devices", reply


async def test_a_job_on_several_devices_is_placed_whole_or_waits(stack, nc, agents):
    """Two nodes with one of their two devices busy each: a 2-device job holds nothing until one node frees
    both, and a 1-device job submitted after it goes to the node not kept for it."""
    for node in ("n1", "n2"):
        agents.start(node, gpus="4096,4096", hold_s=600)
    await wait_nodes(nc, 2)
    busy = {}
    for node in ("n1", "n2"):
        busy[node] = (await submit(nc, held_job(node=node))).job
        await wait_state(nc, busy[node], "running")
    gang = (await submit(nc, held_job(devices=2))).job
    await wait_for(lambda: gang in stack.core.gang_holds.values(), what="a node kept for the 2-device job")
    [kept] = [n for n, j in stack.core.gang_holds.items() if j == gang]
    other = "n2" if kept == "n1" else "n1"
    assert (await get_job(nc, gang)).state == "queued"
    assert gang not in stack.core.fleet.reserved.values(), "part of the job was placed"

    small = (await submit(nc, held_job())).job
    placed = await wait_state(nc, small, "running")
    assert placed.node == other, f"the small job took {placed.node}, kept for the 2-device job"
    assert (await get_job(nc, gang)).state == "queued"

    await cancel(nc, busy[kept])
    running = await wait_state(nc, gang, "running")
    assert running.node == kept and sorted(running.devices) == [0, 1], running
    for job in (gang, small, busy[other]):
        await cancel(nc, job)


async def test_a_pinned_job_on_two_devices_waits_while_small_jobs_flow_elsewhere(stack, nc, agents):
    agents.start("n1", gpus="4096,4096", hold_s=600)
    agents.start("n2", gpus="4096", hold_s=0.3)
    await wait_nodes(nc, 2)
    long = (await submit(nc, held_job(node="n1"))).job
    await wait_state(nc, long, "running")
    gang = (await submit(nc, held_job(node="n1", devices=2))).job
    await wait_for(lambda: stack.core.gang_holds.get("n1") == gang, what="n1 kept for the pinned 2-device job")
    for _ in range(3):  # n1 has a free device and sorts first; they run on n2 all the same, one after another
        small = (await submit(nc, held_job())).job
        done = await wait_state(nc, small, ("succeeded", "failed"))
        assert done.state == "succeeded" and done.node == "n2", done
    assert (await get_job(nc, gang)).state == "queued"
    await cancel(nc, long)
    running = await wait_state(nc, gang, "running")
    assert running.node == "n1" and sorted(running.devices) == [0, 1]
    await cancel(nc, gang)


def ranks_of(job: str) -> dict[int, int]:
    """rank -> pid of the job's trainer processes on this machine (their working directory is the job's)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"/jobs/{job}-" not in os.readlink(entry / "cwd"):
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
        except OSError:
            continue
        if "RANK" in env and start_time(int(entry.name)) is not None:
            found[int(env["RANK"])] = int(entry.name)
    return found


def real_job(model_dir, steps: int, **train) -> dict:
    t = {
        "max_steps": steps,
        "learning_rate": 0.01,
        "batch_size": 2,
        "max_seq_length": 128,
        "warmup_steps": 0,
        "logging_steps": 1,
        **train,
    }
    return {
        "model": "tiny",
        "base_dir": str(model_dir),
        "data": pairs(),
        "devices": 2,
        "lora": {"dropout": 0.0},
        "train": t,
    }


async def test_a_killed_rank_fails_the_job_within_seconds_and_leaves_no_process(stack, nc, agents, tiny_model):
    agents.start("n1", gpus="4096,4096", trainer=None)
    await wait_nodes(nc, 1)
    job = (await submit(nc, real_job(tiny_model, 100_000))).job
    await wait_for(lambda: get_job(nc, job), what="the job")
    await wait_for(lambda: at_step(nc, job, 2), timeout=120, what="two steps on two ranks")
    ranks = ranks_of(job)
    assert sorted(ranks) == [0, 1], ranks
    killed = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    failed = await wait_state(nc, job, ("failed", "succeeded", "cancelled"), timeout=STACK_CONFIG.window + 5)
    took = time.monotonic() - killed
    print(f"rank 1 killed: the job failed {took:.2f} s later: {failed.message}")
    assert failed.state == "failed" and "rank 1 of 2 was killed by signal 9" in failed.message, failed
    assert took < STACK_CONFIG.window + 5
    assert all(start_time(pid) is None for pid in ranks.values()), "a rank outlived the job"
    assert not ranks_of(job)


@pytest.mark.parametrize("packing", [True])
async def test_two_ranks_take_one_process_steps_on_twice_the_batch_through_a_pause(
    stack, nc, agents, tiny_model, tmp_path, capsys, packing
):
    """2 ranks x batch 2 through the agent, paused at step 6 or later and resumed with 2 ranks again, against one
    process with batch 4 in this test process: the same 60 losses within 1e-4 (60 steps, so that the pause comes
    before the end however fast the steps are)."""
    from tests.conftest import spec_for
    from tests.test_trainer import events_from
    from trainer.job.loop import train

    request = real_job(tiny_model, 60, packing=packing)
    spec = spec_for(tiny_model, tmp_path, **{**request["train"], "batch_size": 4})
    train(
        msgspec.structs.replace(
            spec,
            request=msgspec.structs.replace(spec.request, lora=msgspec.structs.replace(spec.request.lora, dropout=0.0)),
        )
    )
    one = {e.step: e.loss for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)}

    agents.start("n1", gpus="4096,4096", trainer=None)
    await wait_nodes(nc, 1)
    reply = await submit(nc, request)
    assert isinstance(reply, Accepted), reply
    await wait_for(lambda: at_step(nc, reply.job, 6), timeout=120, what="six steps before the pause")
    await bus.request(nc, names.PAUSE, JobQuery(reply.job), JobReply)
    paused = await wait_state(nc, reply.job, ("paused", "failed"), timeout=60)
    assert paused.state == "paused", paused.message
    await bus.request(nc, names.RESUME, JobQuery(reply.job), JobReply)
    done = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=120)
    assert done.state == "succeeded", done.message
    two = {
        p.step: p.loss for p in await stream_events(nc, names.job(reply.job).progress, msgspec.json.Decoder(Progress))
    }
    assert sorted(two) == list(range(1, 61))
    worst = max(abs(two[s] - one[s]) for s in two)
    print(f"{paused.message}; 2 ranks x batch 2 against 1 x batch 4 over 60 steps: largest loss difference {worst:.2e}")
    assert worst < 1e-4, worst


def test_a_pause_that_comes_while_the_ranks_agree_is_agreed_on_at_the_next_step(trainer_signals):
    """The agent signals every rank at once, so a signal often lands while a rank waits in the step's agreement: it
    must end the run one step later, not be overwritten by what the ranks had agreed before it came."""
    from trainer.job.distributed import World
    from trainer.job.loop import agree
    from trainer.signals import Signals

    class SignalledWhileAgreeing(World):
        """Rank 0 of two, whose other rank was asked nothing; the pause reaches this one during the sum."""

        def sum(self, *values: float) -> list[float]:
            os.kill(os.getpid(), signal.SIGUSR2)
            return list(values)

    signals, world = Signals(), SignalledWhileAgreeing(rank=0, size=2)
    assert agree(signals, world) is False and not signals.agreed_pause  # agreed before the signal came
    assert agree(signals, world) is True and signals.agreed_pause  # and agreed on at the next step
