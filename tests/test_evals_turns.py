"""The evals service grades runs of samples on each tenant's own turns (services/evals/samples.py): one tenant's
slow runs (a python grader that stalls) never delay another's quick one; its runs past the waiting places are
refused naming the limit, nothing stored; a cancelled run kills its sandbox and leaves no task. Measured against
the clock where it matters (the quick run completed while every slow one was still in progress), never by
sleeping. Real evals service, NATS and sandboxes."""

from __future__ import annotations

import time

import pytest

from schemas import names
from schemas.evals import Criterion, EvalCreate, EvalReply, RunQuery, RunReply, RunRequest, SampledItem
from schemas.graders import PythonGrader, Sample, StringCheckGrader
from schemas.jobs import Error
from services import bus
from services.evals import samples
from services.evals.service import EvalsService
from services.graders import GraderContext, status
from tests.conftest import wait_for
from tests.test_grader_deadline import CALL_STALL, sandbox_processes, sandboxes

pytestmark = pytest.mark.skipif(not status().isolated, reason=f"no sandbox here: {status().why_not}")
# acme's stalling grades must outlast globex's quick run and the look at them after it: a wall-clock limit of 2 s
# (the sandbox's own clock) ended them first when this process (the evals service's too) stalled that long on a
# busy machine; they are cancelled at the end
SLOW_ENOUGH = GraderContext(wall_s=60.0, cpu_s=2.0, memory_mib=256, command="jetlora scheduler")


async def create(nc, tenant: str, name: str, criteria: list[Criterion]) -> None:
    reply = await bus.request(
        nc, names.evals_api(tenant).create, EvalCreate(name=name, criteria=criteria), EvalReply | Error
    )
    assert isinstance(reply, EvalReply), reply


async def start(nc, tenant: str, name: str, output: str) -> RunReply | Error:
    row = SampledItem(item={"answer": "Paris"}, sample=Sample.from_model_sample(output))
    ask = RunRequest(eval=name, base_dir="", samples=[row])
    return await bus.request(nc, names.evals_api(tenant).run, ask, RunReply | Error)


async def state(nc, tenant: str, run: str) -> str:
    reply = await bus.request(nc, names.evals_api(tenant).run_show, RunQuery(run=run), RunReply | Error)
    assert isinstance(reply, RunReply), reply
    return reply.run.state


async def test_the_evals_service_grades_each_tenants_runs_on_its_own_turns(nc, services):
    service, *_ = await services.start(lambda c: EvalsService(c, SLOW_ENOUGH))
    await wait_for(service.ready.is_set, timeout=10, what="the evals service")
    await create(nc, "acme", "slow", [Criterion(grader=PythonGrader(name="p", source=CALL_STALL))])
    exact = StringCheckGrader(name="s", input="{{sample.output_text}}", reference="{{item.answer}}", operation="eq")
    await create(nc, "globex", "quick", [Criterion(grader=exact)])
    held = [await start(nc, "acme", "slow", "stall") for _ in range(samples.AT_ONCE + samples.WAITING)]
    assert all(isinstance(r, RunReply) for r in held), held
    refused = await start(nc, "acme", "slow", "stall")
    assert isinstance(refused, Error) and refused.field == "samples", refused
    assert f"({samples.AT_ONCE} grade at a time, {samples.WAITING} more may wait)" in refused.error
    await wait_for(lambda: sandboxes() >= samples.AT_ONCE, timeout=15, what="acme's sandboxes")

    began = time.monotonic()
    quick = await start(nc, "globex", "quick", "Paris")
    assert isinstance(quick, RunReply), quick
    await wait_for(
        lambda: _ended(nc, "globex", quick.run.id), timeout=30, what="globex's run to complete", interval=0.02
    )
    took = time.monotonic() - began
    states = [await state(nc, "acme", r.run.id) for r in held if isinstance(r, RunReply)]
    assert states == ["in_progress"] * len(held), states  # acme's slow runs were all still going: no wait on them
    print(f"globex's run of samples while acme's {len(held)} runs graded or waited: {took * 1000:.0f} ms")

    for r in held:  # cancelled: their sandboxes killed, nothing left grading
        assert isinstance(r, RunReply)
        await bus.request(nc, names.evals_api("acme").run_cancel, RunQuery(run=r.run.id), RunReply | Error)
    await wait_for(lambda: not sandbox_processes(), timeout=3, what="no sandbox left")
    await wait_for(lambda: not service.sampled.tasks and not service.sampled.held, timeout=3, what="no run task left")


async def _ended(nc, tenant: str, run: str) -> bool:
    found = await state(nc, tenant, run)
    assert found in ("in_progress", "completed"), found
    return found == "completed"
