"""A real agent runs a co-training group: assignments naming one group on one device start the group's trainer
process with the first job and add the next into it (the device is the group's, not busy to it); a pause and a
cancel act on one job alone; the others train to their end and store their own adapters; heartbeats report each
job's attempt with its group. (No scheduler here: it would end attempts it never assigned; the job records the
artifact service checks uploads against are written as the scheduler would.)"""

from __future__ import annotations


import msgspec

from schemas import names
from schemas.events import StateChange
from schemas.jobs import JobRequest
from schemas.nodes import CPU_DEVICE, AssignAccepted, Assignment, AssignReply, Control, ControlReply, Heartbeat
from services import bus
from services.agent.config import AgentConfig
from services.agent.service import Agent
from services.artifacts.service import ArtifactService
from tests.conftest import running_on, wait_for
from tests.qa import pairs

FINAL = ("succeeded", "failed", "cancelled", "paused", "stopped")


async def test_an_agent_runs_jobs_of_one_group_in_one_process(services, nc, tiny_model, tmp_path):
    await services.start(lambda c: ArtifactService(c))
    config = AgentConfig(node="n1", work_dir=tmp_path / "agent", offer_cpu=True, heartbeat_interval=0.25)
    await services.start(lambda c: Agent(c, config))
    states: dict[str, list[StateChange]] = {}
    beats: list[Heartbeat] = []

    async def on_state(msg) -> None:
        ev = msgspec.json.decode(msg.data, type=StateChange)
        states.setdefault(ev.job, []).append(ev)

    async def on_beat(msg) -> None:
        beats.append(msgspec.json.decode(msg.data, type=Heartbeat))

    await nc.subscribe(names.job().state, cb=on_state)
    await nc.subscribe(names.node("n1").heartbeat, cb=on_beat)
    await wait_for(lambda: beats, what="the agent's first heartbeat")
    train = {"max_steps": 6, "learning_rate": 0.01, "batch_size": 1, "max_seq_length": 128, "precision": "fp32"}
    request = msgspec.convert(
        {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "train": train, "accelerator": "cpu"},
        JobRequest,
    )
    for job in ("j1", "j2", "j3"):
        await running_on(nc, job)
        a = Assignment(job=job, device=CPU_DEVICE, attempt=1, request=request, group="g")
        reply = await bus.request(nc, names.node("n1").assign, a, AssignReply)
        assert isinstance(reply, AssignAccepted), reply

    def running(job: str) -> bool:
        return any(s.state == "running" for s in states.get(job, []))

    await wait_for(lambda: running("j2") and running("j3"), timeout=60, what="j2 and j3 training")
    for job, action in (("j2", "pause"), ("j3", "cancel")):
        reply = await bus.request(nc, names.node("n1").control, Control(job=job, action=action), ControlReply)
        assert reply.ok, reply

    def ended(job: str) -> str | None:
        return next((s.state for s in states.get(job, []) if s.state in FINAL), None)

    await wait_for(lambda: all(ended(j) for j in ("j1", "j2", "j3")), timeout=90, what="every job's end")
    assert (ended("j1"), ended("j2"), ended("j3")) == ("succeeded", "paused", "cancelled"), states
    done = next(s for s in states["j1"] if s.state == "succeeded")
    assert [a.kind for a in done.artifacts][:1] == ["peft"]
    grouped = [a for b in beats for a in b.attempts if a.job == "j1"]
    assert grouped and all(a.group == "g" for a in grouped)
    assert any(s.checkpoint is not None for s in states["j2"]), "the pause's checkpoint was stored"


async def test_a_superseded_attempts_checkpoint_and_end_never_pass_for_the_next_ones(tiny_model, tmp_path, caplog):
    """The agent's side of a group (services/agent/group_run.py) with the real group trainer: attempt 1 of a job is
    asked to pause and, before its checkpoint and its end come, attempt 2 of the job joins (placed again at once):
    attempt 1's checkpoint and Finished are dropped and logged, never taken for attempt 2's, which trains to its
    own end in its own directory."""
    import asyncio
    import logging

    from schemas.events import Cancelled, Finished, Progress, Started, TrainerSpec
    from services.agent.group_run import DEFAULT_GROUP_TRAINER, GroupProcess

    def spec(attempt: int, steps: int) -> TrainerSpec:
        train = {"max_steps": steps, "learning_rate": 0.01, "batch_size": 1, "max_seq_length": 128}
        request = msgspec.convert(
            {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "train": train}, JobRequest
        )
        return TrainerSpec(job="a", attempt=attempt, request=request, out_dir=str(tmp_path / f"a-{attempt}"))

    caplog.set_level(logging.INFO, logger="services.agent.group_run")
    group = GroupProcess("g", tmp_path / "g", DEFAULT_GROUP_TRAINER, {})
    seen: dict[int, list] = {1: [], 2: []}

    def collect(attempt: int):
        async def on_event(ev) -> None:
            seen[attempt].append(ev)

        return on_event

    first = group.member(spec(1, 400))
    one = asyncio.create_task(first.run(collect(1)))
    await wait_for(lambda: any(isinstance(e, Progress) for e in seen[1]), timeout=60, what="attempt 1 under way")
    first.pause()  # its checkpoint and its end are on their way when attempt 2 joins
    second = group.member(spec(2, 3))
    async with group._starting:  # attempt 2's line held back (as a slow pipe would) until attempt 1's end has come
        two = asyncio.create_task(second.run(collect(2)))
        await wait_for(lambda: "Finished event of job a attempt 1" in caplog.text, timeout=60, what="attempt 1's end")
    done = await asyncio.wait_for(two, 60)
    first.cancel()
    assert isinstance(await asyncio.wait_for(one, 10), Cancelled)
    assert isinstance(done, Finished) and done.state == "trained" and done.step == 3, done
    assert done.adapter_dir.startswith(str(tmp_path / "a-2"))
    assert [e.steps for e in seen[2] if isinstance(e, Started)] == [3]
    assert [e.step for e in seen[2] if isinstance(e, Progress)] == [1, 2, 3]
    assert "dropped a Checkpoint event of job a attempt 1 (attempt 2 runs now)" in caplog.text, caplog.text
    assert "dropped a Finished event of job a attempt 1 (attempt 2 runs now)" in caplog.text, caplog.text
    assert not any(isinstance(e, Finished) for e in seen[1])  # nor was it its own run's: that one had left


async def test_a_member_cancelled_before_it_ran_leaves_no_empty_group_behind(tmp_path, tiny_model):
    """The agent made the group for a job that was cancelled before its run began: the group is forgotten (no
    process was ever started), as when its last member leaves."""
    import asyncio

    from schemas.events import Cancelled, TrainerSpec
    from services.agent.group_run import DEFAULT_GROUP_TRAINER, GroupProcess

    request = msgspec.convert({"model": "tiny", "base_dir": str(tiny_model), "data": pairs()}, JobRequest)
    spec = TrainerSpec(job="a", attempt=1, request=request, out_dir=str(tmp_path / "a"))
    forgotten: list[GroupProcess] = []
    group = GroupProcess("g", tmp_path / "g", DEFAULT_GROUP_TRAINER, {}, on_empty=forgotten.append)
    member = group.member(spec)
    member.cancel()
    assert isinstance(await member.run(lambda ev: asyncio.sleep(0)), Cancelled)
    assert forgotten == [group] and group.closing and group.proc is None and not group.members
