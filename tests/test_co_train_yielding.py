"""Yielding to a serving engine member by member, in one co-training group, against a real agent and an engine's
metrics served on a local port (tests/test_yielding.py's stand-in): while the engine serves, each job that must
yield sits out the group's steps, and the group's process is stopped only while all of them do; one member's pause
lets that member alone compute to its checkpoint (the other, still yielding, takes no step); an admin's job exempt
from yielding (priority above --engine-yield exempt=P) trains on in the same process while its neighbour waits;
when the engine is idle again the waiting job goes on and finishes."""

from __future__ import annotations

import msgspec
import pytest

from schemas import names
from schemas.events import Progress, StateChange
from schemas.jobs import JobRequest
from schemas.nodes import CPU_DEVICE, AssignAccepted, Assignment, AssignReply, Control, ControlReply
from services import bus
from services.agent.config import AgentConfig
from services.agent.engines import Engine
from services.agent.service import Agent
from services.agent.yielding import YieldPolicy
from services.artifacts.service import ArtifactService
from tests.conftest import running_on, wait_for
from tests.qa import pairs
from tests.test_yielding import Metrics

pytestmark = pytest.mark.timeout(180)
FINAL = ("succeeded", "failed", "cancelled", "paused", "stopped")


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP) where it stands."""
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"


async def test_each_member_yields_by_its_own_rule_and_one_members_pause_never_frees_another(
    services, nc, tiny_model, tmp_path
):
    engine = Metrics()
    try:
        await _run(services, nc, tiny_model, tmp_path, engine)
    finally:
        engine.close()


async def _run(services, nc, tiny_model, tmp_path, engine: Metrics) -> None:
    await services.start(lambda c: ArtifactService(c))
    config = AgentConfig(
        node="n1",
        work_dir=tmp_path / "agent",
        offer_cpu=True,
        heartbeat_interval=0.25,
        engines=[Engine(kind="vllm", model="tiny", url=engine.url)],
        engine_yield=[YieldPolicy.parse("compute,poll=0.05,holdoff=0.3,exempt=5,nice=0")],
    )
    agent, *_ = await services.start(lambda c: Agent(c, config))
    states: dict[str, list[StateChange]] = {}
    steps: dict[str, int] = {}

    async def on_state(msg) -> None:
        ev = msgspec.json.decode(msg.data, type=StateChange)
        states.setdefault(ev.job, []).append(ev)

    async def on_progress(msg) -> None:
        p = msgspec.json.decode(msg.data, type=Progress)
        steps[p.job] = max(steps.get(p.job, 0), p.step)

    await nc.subscribe(names.job().state, cb=on_state)
    await nc.subscribe(names.job().progress, cb=on_progress)

    async def assign(job: str, max_steps: int, priority: int | None) -> None:
        train = {"max_steps": max_steps, "learning_rate": 0.01, "batch_size": 1, "max_seq_length": 128}
        request = msgspec.convert(
            {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "train": train, "accelerator": "cpu"},
            JobRequest,
        )
        await running_on(nc, job)
        a = Assignment(job=job, device=CPU_DEVICE, attempt=1, request=request, group="g", engine_priority=priority)
        assert isinstance(await bus.request(nc, names.node("n1").assign, a, AssignReply), AssignAccepted)

    def ended(job: str) -> str | None:
        return next((s.state for s in states.get(job, []) if s.state in FINAL), None)

    def message(job: str, *words: str) -> bool:
        return any(all(w in s.message for w in words) for s in states.get(job, []))

    await assign("y1", 400, None)  # a tenant's jobs: they always yield
    await assign("y2", 60, None)
    await wait_for(lambda: steps.get("y1", 0) >= 2 and steps.get("y2", 0) >= 2, timeout=60, what="both training")
    pid = agent.groups["g"].proc.pid

    engine.set(running=2, waiting=1)  # the engine serves: both yield, so the whole process stops
    await wait_for(lambda: stopped(pid), timeout=20, what="the group's process stopped for the engine")
    assert message("y1", "yielding to vllm") and message("y2", "yielding to vllm")
    y2_held_at = steps["y2"]

    reply = await bus.request(nc, names.node("n1").control, Control(job="y1", action="pause"), ControlReply)
    assert reply.ok, reply
    await wait_for(lambda: ended("y1") == "paused", timeout=60, what="y1 to reach its checkpoint and pause")
    await wait_for(lambda: stopped(pid), timeout=20, what="the process stopped again: y2 still yields")
    assert steps["y2"] <= y2_held_at + 1  # the step under way when it stopped, at most: then y2 sat out

    await assign("admin", 12, 10)  # an admin's job above exempt=5: it does not yield, y2 still does
    await wait_for(lambda: ended("admin") == "succeeded", timeout=60, what="the exempt job to train to its end")
    assert steps["admin"] == 12 and not message("admin", "yielding")
    assert steps["y2"] <= y2_held_at + 1  # it took no step beside the exempt one while the engine served
    await wait_for(lambda: stopped(pid), timeout=20, what="the process stopped once the exempt job had left")

    engine.set(running=0, waiting=0)
    await wait_for(lambda: ended("y2") == "succeeded", timeout=60, what="y2 to go on and finish once idle")
    assert steps["y2"] == 60 and message("y2", "training again")
    done = next(s for s in states["y2"] if s.state == "succeeded")
    assert "yielded" in done.message and [a.kind for a in done.artifacts][:1] == ["peft"]
