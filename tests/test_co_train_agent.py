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
