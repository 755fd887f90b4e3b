"""`jetlora why` of a job that waits for a node resting after unanswered assignments (services/scheduler/unanswered.py)
names the rest, for a job that was never sent there too: a job pinned to the resting node (the only node it may
run on) was told "n0 could take it; it waits behind jobs of higher priority or submitted earlier", while the
placer passed n0 over for up to a minute and nothing was ahead of it. Real nats-server and scheduler; the node
speaks the agent's protocol from the test (tests/harness/node.py)."""

from __future__ import annotations

from schemas import names
from schemas.job_status import JobQuery, JobWhy
from schemas.jobs import Accepted
from services import bus
from services.scheduler.core import SchedulerConfig
from tests.conftest import start_stack, submit, wait_for, wait_nodes
from tests.harness.node import ScriptedNode
from tests.qa import pairs

TIMEOUT_S = 1.0  # the assignment timeout: n0's second rest is 2 s, long enough to ask `why` within it
JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}


async def test_why_names_the_rest_of_the_node_a_pinned_job_waits_for(nc, services):
    await start_stack(
        services, SchedulerConfig(co_train="off", heartbeat_interval=0.25, misses=3, assign_timeout=TIMEOUT_S)
    )
    n0 = ScriptedNode(nc, "n0")
    n0.answer_assignments = False
    await n0.start()
    try:
        await wait_nodes(nc, 1)
        first = await submit(nc, JOB)
        assert isinstance(first, Accepted), first
        await wait_for(
            lambda: _why_says(nc, first.job, "did not answer 2 assignments in a row"),
            timeout=30,
            what="n0 resting after its second unanswered assignment",
        )
        pinned = await submit(nc, {**JOB, "node": "n0"})  # submitted while n0 rests: never sent there yet
        assert isinstance(pinned, Accepted), pinned
        why = await bus.request(nc, names.jobs_api(None).why, JobQuery(pinned.job), JobWhy)
        sent = {a.job for a in n0.assignments}
        assert pinned.job not in sent, "asked after n0's rest (2 s): its own re-queue's message would say it"
        assert "n0 did not answer" in why.summary, why.summary
        assert "could take it" not in why.summary, why.summary
        assert any(w.node == "n0" and "did not answer" in w.reason for w in why.nodes), why.nodes
    finally:
        await n0.close()


async def _why_says(nc, job: str, words: str) -> bool:
    why = await bus.request(nc, names.jobs_api(None).why, JobQuery(job), JobWhy)
    return words in why.summary
