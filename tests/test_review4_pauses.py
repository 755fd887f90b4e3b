"""Review of the agent's pauses (#63): a job's attempt is reported `paused` (the scheduler then keeps it among the
job's paused_attempts, and the Tinker gateway tells its client nothing was lost) only once the checkpoint its
trainer took when it paused is stored whole, in the same write that names that checkpoint; and what the agent has
said or is saying of a pause is never overwritten by its shutdown. Real processes: nats-server, the scheduler, the
artifact service and an agent (the stand-in trainer), each behind a proxy that injects the fault."""

from __future__ import annotations

import os
import signal

import msgspec
import nats
import pytest

from schemas import names
from schemas.events import StateChange
from schemas.job_status import JobQuery, JobReply
from services import bus
from services.procs import PID_FILE
from tests.conftest import answering, get_job, states_of, submit, wait_for, wait_nodes
from tests.harness import Stack
from tests.qa import pairs

pytestmark = pytest.mark.timeout(300)
STEPS = 40  # the stand-in's steps: 0.5 s each (HOLD_S 20 s), so the pause lands long before the job's end
HOLD_S = 20.0


async def running_job(stack: Stack, nc) -> str:
    """A job of the stand-in trainer on n1, a few steps in."""
    await answering(nc, names.LIST_JOBS)
    await wait_nodes(nc, 1)
    job = (await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2)})).job

    async def stepped() -> bool:
        return (await get_job(nc, job)).step >= 3

    await wait_for(stepped, timeout=60, what="a few steps before the pause")
    return job


async def pause(nc, job: str) -> None:
    reply = await bus.request(nc, names.PAUSE, JobQuery(job), JobReply)
    assert reply.job.id == job, reply


async def attempt_ended(nc, job: str, attempt: int = 1, timeout: float = 60) -> StateChange:
    """The last state the attempt's node reported, once it is an ending (not preparing, running or uploading)."""

    async def ended() -> StateChange | None:
        mine = [e for e in await states_of(nc, job) if e.attempt == attempt]
        last = mine[-1] if mine else None
        return last if last and last.state not in ("preparing", "running", "uploading") else None

    return await wait_for(ended, timeout=timeout, interval=0.3, what=f"attempt {attempt} of {job} ending")


def trainer_gone(stack: Stack, job: str) -> bool:
    """The attempt's trainer has exited (the agent removes its pid file once it has)."""
    job_dir = stack.tmp / "agents" / "n1" / "jobs" / f"{job}-1"
    return job_dir.is_dir() and not (job_dir / PID_FILE).exists()


def start(stack: Stack, artifacts: bool = True) -> None:
    stack.start_scheduler("sched")
    if artifacts:
        stack.start_artifacts("arts")
    stack.start_agent("n1", gpus="4096", hold_s=HOLD_S, env={"HOLD_STEPS": str(STEPS)})


async def test_a_pause_whose_checkpoint_was_not_stored_is_a_loss_not_a_pause(tmp_path):
    """The artifact service is down when the job pauses: its checkpoint cannot be stored, so the attempt must not
    be reported paused (the job would go on from an older checkpoint, or none, while the gateway told a session's
    client nothing was lost); it is handed back, not among paused_attempts, and the agent's log tells the operator
    what happened and what to do."""
    async with Stack(tmp_path) as stack:
        start(stack, artifacts=False)
        nc = await nats.connect(stack.client_url)
        try:
            job = await running_job(stack, nc)
            await pause(nc, job)
            end = await attempt_ended(nc, job)
            assert end.state == "queued", end
            assert end.checkpoint is None
            assert "not stored" in end.message and "jetlora artifacts" in end.message, end.message
            status = await get_job(nc, job)
            assert 1 not in status.paused_attempts, status
            log = stack.log("n1")
            assert "pause at step" in log and "is not kept" in log, log[-3000:]
        finally:
            await nc.close()


async def test_a_paused_run_is_not_handed_back_by_the_shutdown_that_finds_it_ending(tmp_path):
    """The job paused and said so; the agent is still letting go of the attempt's trainer lease (its writes to the
    bucket unanswered) when it is told to shut down. The pause stands: the shutdown reports nothing more of it (it
    reported it queued, which the scheduler took as the job's new state: a paused job queued again)."""
    async with Stack(tmp_path) as stack:
        start(stack)
        nc = await nats.connect(stack.client_url)
        try:
            job = await running_job(stack, nc)
            arts = stack.stall("arts", 120.0)  # the pause's checkpoint waits in the upload until the KV hold is on
            try:
                await pause(nc, job)
                await wait_for(lambda: trainer_gone(stack, job), timeout=60, what="the paused trainer gone")
                stack.hold_writes("n1", prefixes=("$KV.",), mode="drop")  # the lease's release goes unanswered
            finally:
                arts.resume()
            paused = await attempt_ended(nc, job)
            assert paused.state == "paused", paused
            assert stack.terminate("n1") == 0
            states = [(e.attempt, e.state) for e in await states_of(nc, job)]
            assert states[-1] == (1, "paused"), states
            assert (await get_job(nc, job)).state == "paused"
            one_write(await states_of(nc, job))
        finally:
            await nc.close()


async def test_a_pause_being_reported_when_the_agent_shuts_down_is_reported_paused(tmp_path):
    """The pause's checkpoint is stored; its state event is on its way but JetStream does not take it (the agent's
    writes there dropped) when the agent is told to shut down, and the writes flow again while it shuts down. The
    attempt ended in a pause, with its checkpoint: that is what the shutdown says (it said queued, so the pause was
    lost, and with it the checkpoint's record)."""
    async with Stack(tmp_path) as stack:
        start(stack)
        nc = await nats.connect(stack.client_url)
        try:
            job = await running_job(stack, nc)
            state_subject = names.job(job, "n1", names.tenant_token(None)).state
            stack.hold_writes("n1", prefixes=(state_subject,), mode="drop")
            await pause(nc, job)
            await wait_for(
                lambda: "JetStream did not take " + state_subject in stack.log("n1"),
                timeout=60,
                what="the pause's state event held back",
            )
            os.kill(stack.pid("n1"), signal.SIGTERM)
            await wait_for(lambda: "stopping:" in stack.log("n1"), timeout=30, what="the agent shutting down")
            stack.release_writes("n1")
            await wait_for(lambda: not stack.service("n1").alive, timeout=60, what="the agent gone")
            events = await states_of(nc, job)
            assert [(e.attempt, e.state) for e in events][-1] == (1, "paused"), [(e.state, e.message) for e in events]
            one_write(events)
            status = await get_job(nc, job)
            assert status.state == "paused" and 1 in status.paused_attempts, status
        finally:
            await nc.close()


async def test_a_pause_still_storing_its_checkpoint_when_the_agent_shuts_down_is_given_the_time_to(tmp_path):
    """The paused trainer has exited; its checkpoint is on its way to an artifact service that answers a moment
    later, after the agent was told to shut down. That run no longer runs: the shutdown waits for its checkpoint
    (within its own deadline) and the attempt ends paused (it was killed in the upload and handed back queued)."""
    async with Stack(tmp_path) as stack:
        start(stack)
        nc = await nats.connect(stack.client_url)
        try:
            job = await running_job(stack, nc)
            arts = stack.stall("arts", 120.0)
            try:
                await pause(nc, job)
                await wait_for(lambda: trainer_gone(stack, job), timeout=60, what="the paused trainer gone")
                os.kill(stack.pid("n1"), signal.SIGTERM)
                await wait_for(lambda: "stopping:" in stack.log("n1"), timeout=30, what="the agent shutting down")
            finally:
                arts.resume()
            await wait_for(lambda: not stack.service("n1").alive, timeout=60, what="the agent gone")
            events = await states_of(nc, job)
            assert [(e.attempt, e.state) for e in events][-1] == (1, "paused"), [(e.state, e.message) for e in events]
            one_write(events)
            assert (await get_job(nc, job)).state == "paused"
        finally:
            await nc.close()


async def test_a_session_paused_for_idleness_names_its_checkpoint_in_the_paused_report(tmp_path, tiny_model):
    """A training session nobody calls pauses by itself (no pause was asked of it: its trainer checkpoints and ends
    after idle_s); on the real session trainer, its paused report names the checkpoint, in one write, as an asked
    pause's does."""
    async with Stack(tmp_path) as stack:
        stack.start_scheduler("sched")
        stack.start_artifacts("arts")
        stack.start_agent("n1", "--offer-cpu", gpus=None, trainer=None)
        nc = await nats.connect(stack.client_url)
        try:
            await answering(nc, names.LIST_JOBS)
            await wait_nodes(nc, 1)
            request = {
                "model": "tiny",
                "base_dir": str(tiny_model),
                "train": {"method": "session"},
                "accelerator": "cpu",
                "session": {"rank": 4, "seed": 3, "idle_s": 10},
            }
            job = (await submit(nc, request)).job
            end = await attempt_ended(nc, job, timeout=120)
            assert end.state == "paused", end
            one_write(await states_of(nc, job))
        finally:
            await nc.close()


def one_write(events: list[StateChange]) -> None:
    """The pause's checkpoint is named by the paused event itself, never by a write before it: killed between two
    writes, the agent would leave the checkpoint recorded and the pause not (a loss told where none was), or the
    other way round."""
    paused = [e for e in events if e.state == "paused"]
    assert len(paused) == 1 and paused[0].checkpoint is not None, paused
    step = paused[0].checkpoint.step
    assert not [e for e in events if e.state == "running" and e.checkpoint and e.checkpoint.step == step], [
        msgspec.json.encode(e).decode() for e in events
    ]
