"""A node that never answers its assignments (no acceptance, no refusal) while its heartbeats come is given no job for
a while after each one it leaves unanswered, the while doubling (from the assignment timeout, capped), and the jobs
go to another node meanwhile; the operator reads why in the job's message (and `jetlora why`). Once the node answers
an assignment, it starts over. Before, the scheduler assigned the job to that node again at every assignment
timeout, for as long as its heartbeats came. Real nats-server and scheduler; the nodes speak the agent's protocol
from the test (tests/harness/node.py)."""

from __future__ import annotations

from schemas import names
from schemas.job_status import JobQuery, JobWhy
from schemas.jobs import Accepted
from services import bus
from services.scheduler.core import SchedulerConfig
from services.scheduler.unanswered import Unanswered
from tests.conftest import start_stack, submit, wait_for, wait_nodes, wait_state
from tests.harness.node import ScriptedNode
from tests.qa import pairs

TIMEOUT_S = 0.5  # the scheduler's assignment timeout: the first rest is as long
SLACK_S = 0.05  # what a gap may fall short of its rest by (the clocks of two processes' timers)
JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}


def test_a_nodes_rest_doubles_to_its_cap_and_starts_over_once_it_answers():
    silent = Unanswered(first_s=1.0, cap_s=8.0)
    rests = [silent.missed("n0", sent=t, now=t + 0.5).rest_s for t in range(6)]
    assert rests == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0], rests
    assert silent.resting(now=13.4) == {"n0"} and silent.resting(now=13.6) == frozenset()
    assert "did not answer 6 assignments in a row" in silent.words("n0")
    assert silent.missed("n0", sent=5.2, now=6.0).misses == 6  # sent before the last miss was counted: one pass's
    silent.answered("n0")
    assert silent.resting(now=6.0) == frozenset()
    assert silent.missed("n0", sent=7.0, now=7.5).rest_s == 1.0  # started over


async def test_a_node_that_never_answers_assignments_is_tried_less_and_less_often(nc, services):
    await start_stack(
        services, SchedulerConfig(co_train="off", heartbeat_interval=0.25, misses=3, assign_timeout=TIMEOUT_S)
    )
    n0 = ScriptedNode(nc, "n0")
    n0.answer_assignments = False
    await n0.start()
    n1: ScriptedNode | None = None
    try:
        await wait_nodes(nc, 1)
        reply = await submit(nc, JOB)
        assert isinstance(reply, Accepted), reply
        await wait_for(lambda: len(n0.assignments) >= 4, timeout=30, what="4 assignments to n0")
        gaps = [b - a for a, b in zip(n0.assigned_at, n0.assigned_at[1:])]
        for k, gap in enumerate(gaps[:3], 1):  # the assignment's own timeout, then the node's k-th rest
            least = TIMEOUT_S + TIMEOUT_S * 2 ** (k - 1)
            assert gap >= least - SLACK_S, f"n0 was assigned the job again {gap:.2f} s after miss {k} (<{least} s)"
        said = await wait_for(lambda: _why(nc, reply.job), timeout=30, what="`why` naming n0's silence")
        assert "in a row" in said, said
        n1 = await ScriptedNode(nc, "n1").start()  # a node that answers: the job goes there, not back to n0
        await wait_for(lambda: reply.job in n1.running, timeout=30, what="the job on n1")
        await n1.report(reply.job, "running")
        await wait_state(nc, reply.job, "running")
        n0.answer_assignments = True  # n0 answers its next one: its rests start over
        answered = await submit(nc, {**JOB, "node": "n0"})
        await wait_for(lambda: answered.job in n0.running, timeout=60, what="n0 answering an assignment")
        await n0.report(answered.job, "succeeded")
        n0.answer_assignments = False
        before = len(n0.assignments)
        again = await submit(nc, {**JOB, "node": "n0"})
        await wait_for(lambda: len(n0.assignments) >= before + 2, timeout=30, what="2 more assignments to n0")
        gap = n0.assigned_at[before + 1] - n0.assigned_at[before]
        assert gap < TIMEOUT_S + 2 * TIMEOUT_S, f"after an answer, n0's first rest was {gap - TIMEOUT_S:.2f} s"
        assert all(a.job == again.job for a in n0.assignments[before:]), n0.assignments[before:]
    finally:
        await n0.close()
        if n1 is not None:
            await n1.close()


async def _why(nc, job: str) -> str | None:
    """What `jetlora why` says of the job, while it says n0 did not answer (it is queued, n0 resting)."""
    why = await bus.request(nc, names.jobs_api(None).why, JobQuery(job), JobWhy)
    return why.summary if "node n0 did not answer" in why.summary else None
