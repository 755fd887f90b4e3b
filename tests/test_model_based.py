"""The scheduler under random interleavings (hypothesis's stateful testing): submissions, pauses, resumes, cancels,
slow store writes and nodes killed and restarted, against the real scheduler and real agents; after every step, once
no write is in flight, the invariants hold: a reservation belongs to an active job on that node, a queued job is on
no node, memory and the store agree, and an idempotency key gives one job."""

from __future__ import annotations

import asyncio

import nats
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from schemas import names
from schemas.jobs import Accepted, Error, SubmitReply
from schemas.job_status import ACTIVE_STATES, JobQuery, JobReply
from services import bus
from services.embedded import EmbeddedNats
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import Agents, slowed, wait_for
from tests.qa import pairs

NODES = ("m1", "m2")


class World:
    """One nats-server, one scheduler on a loop of our own, agents as processes; shared by every example."""

    def __init__(self, tmp) -> None:
        self.server = EmbeddedNats(store_dir=tmp / "nats").start()
        self.loop = asyncio.new_event_loop()
        self.agents = Agents(self.server.url, tmp)
        self.run(self._start())
        for node in NODES:
            self.agents.start(node, gpus="4096,4096", hold_s=60, interval=0.25)
        self.run(wait_for(lambda: len(self.sched.core.fleet.nodes) == len(NODES), timeout=30, what="both agents"))

    async def _start(self) -> None:
        self.nc = await nats.connect(self.server.url)
        await bus.ensure_resources(self.nc)
        self.stop = asyncio.Event()
        self.sched = Scheduler(
            await nats.connect(self.server.url),
            SchedulerConfig(co_train="off", heartbeat_interval=0.25, misses=3, assign_timeout=2.0),
        )
        self.task = self.loop.create_task(self.sched.run(self.stop))
        await asyncio.wait_for(self.sched.leading.wait(), 10)
        self.write = self.sched.core.store.write_status

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def settle(self) -> None:
        """Until no task the scheduler spawned runs and no job's status is being written."""
        self.run(
            wait_for(
                lambda: not self.sched.core.tasks and not any(j.lock.locked() for j in self.sched.core.jobs.values()),
                timeout=20,
                interval=0.02,
                what="the scheduler to settle",
            )
        )

    def close(self) -> None:
        self.agents.close()
        self.stop.set()
        self.run(asyncio.wait_for(self.task, 15))
        self.run(self.nc.close())
        self.loop.close()
        self.server.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("model"))
    yield w
    w.close()


class SchedulerModel(RuleBasedStateMachine):
    world: World
    checks = 0  # how many times the invariants were checked, over all examples
    submitted = 0

    def __init__(self) -> None:
        super().__init__()
        self.jobs: list[str] = []
        self.by_key: dict[str, set[str]] = {}
        self.down: set[str] = set()

    def ask(self, subject: str, message, reply_type):
        return self.world.run(bus.request(self.world.nc, subject, message, reply_type, timeout=10))

    @rule(mib=st.sampled_from([1000, 3000]), priority=st.integers(-1, 1), key=st.sampled_from([None, "k1", "k2"]))
    def submit(self, mib, priority, key):
        job = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": mib, "priority": priority}
        if key:
            job["idempotency_key"] = f"{key}-{mib}-{priority}"
        reply = self.ask(names.SUBMIT, job, SubmitReply)
        if isinstance(reply, Accepted):
            SchedulerModel.submitted += 1
            self.jobs.append(reply.job)
            if key:
                self.by_key.setdefault(job["idempotency_key"], set()).add(reply.job)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), verb=st.sampled_from(["pause", "resume", "cancel"]))
    def control(self, data, verb):
        job = data.draw(st.sampled_from(self.jobs))
        self.ask(getattr(names.jobs_api(), verb), JobQuery(job), JobReply | Error)

    @rule(slow=st.booleans())
    def store_speed(self, slow):
        self.world.sched.core.store.write_status = slowed(self.world.write) if slow else self.world.write

    @precondition(lambda self: len(self.down) < len(NODES))
    @rule(data=st.data())
    def kill_node(self, data):
        node = data.draw(st.sampled_from([n for n in NODES if n not in self.down]))
        self.world.agents.kill(node)
        self.down.add(node)

    @precondition(lambda self: self.down)
    @rule()
    def restart_node(self):
        node = self.down.pop()
        self.world.agents.start(node, gpus="4096,4096", hold_s=60, interval=0.25)

    @invariant()
    def holds(self):
        SchedulerModel.checks += 1
        w = self.world
        w.settle()
        sched = w.sched
        for slot, job_id in sched.core.fleet.reserved.items():
            job = sched.core.jobs[job_id]
            assert job.status.state in ACTIVE_STATES and job.status.node == slot[0], (slot, job.status)
        for job_id in sched.core.queue.ids():
            status = sched.core.jobs[job_id].status
            assert status.state == "queued" and status.node is None, (job_id, status)
        for job_id in self.jobs:
            job = sched.core.jobs[job_id]
            if job.status.state in ("queued", "paused") or job.status.state not in ACTIVE_STATES:
                assert job_id not in sched.core.fleet.reserved.values(), (job_id, job.status)
        self.memory_matches_the_store()
        assert all(len(jobs) == 1 for jobs in self.by_key.values()), self.by_key

    def memory_matches_the_store(self):
        """Read at the same revision, memory and the store say the same (state, node, attempt) of every job."""
        w = self.world
        for _ in range(5):
            stored = {
                job_id: w.run(w.sched.core.store.status(job_id)) for job_id in self.jobs
            }  # the loop runs meanwhile
            w.settle()  # then stands still while memory is read
            jobs = {job_id: w.sched.core.jobs[job_id] for job_id in self.jobs}
            if all(s is None or s[1] == jobs[j].revision for j, s in stored.items()):
                for job_id, s in stored.items():
                    if s is not None:
                        status = jobs[job_id].status
                        assert (s[0].state, s[0].node, s[0].attempt) == (status.state, status.node, status.attempt), (
                            job_id,
                            s[0],
                            status,
                        )
                return
        raise AssertionError("the store kept changing while it was compared with memory")

    def teardown(self):
        self.world.sched.core.store.write_status = self.world.write
        for job in self.jobs:  # the next example starts with the fleet free
            self.ask(names.CANCEL, JobQuery(job), JobReply | Error)
        for node in list(self.down):
            self.down.discard(node)
            self.world.agents.start(node, gpus="4096,4096", hold_s=60, interval=0.25)


def test_the_scheduler_keeps_its_invariants_under_random_interleavings(world):
    SchedulerModel.world = world
    runner = SchedulerModel.TestCase
    runner.settings = settings(
        max_examples=10, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
    )
    runner().runTest()
    print(f"invariants checked {SchedulerModel.checks} times over {SchedulerModel.submitted} submitted jobs")
    assert SchedulerModel.checks >= 6 and SchedulerModel.submitted > 0
