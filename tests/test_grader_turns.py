"""Grader work no tenant can hold for another, and no request can make unbounded, at the gateway's graders
endpoints: turns per tenant (a tenant's calls past its turns and waiting places refused 429 naming the limit); a
multi grader's size capped and a request's sandbox time bounded, each refused 400 naming it. Measured against the
clock where it matters (one tenant's quick call done while the other's slow ones are still running), never by
sleeping. Real gateway, NATS and sandboxes (tests/test_evals_turns.py: the evals service's turns)."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from services.gateway.app import Gateway
from services.graders import GraderContext
from services.graders.check import MAX_GRADERS
from tests.conftest import wait_for
from tests.test_gateway import client_for
from tests.test_gateway_graders import EXACT, SANDBOX
from tests.test_grader_deadline import CALL_STALL, MODULE_STALL, sandbox_processes, sandbox_start_s, sandboxes

FAST = dict(wall_s=2.0, cpu_s=2.0, memory_mib=256)


@pytest.fixture
async def gateway(nc):
    gw = Gateway(nc, {}, port=0, graders=GraderContext(**FAST, tenant_calls=2, tenant_waiting=1, request_sandbox_s=3.0))
    await gw.start()
    yield gw
    await gw.close()


def python(source: str, name: str = "p") -> dict:
    return {"type": "python", "name": name, "source": source}


@SANDBOX
async def test_one_tenants_slow_validates_do_not_delay_anothers_and_its_extra_calls_are_refused(nc, gateway):
    acme, globex = await client_for(nc, gateway, "acme"), await client_for(nc, gateway, "globex")
    slow = [
        asyncio.create_task(acme.fine_tuning.alpha.graders.validate(grader=python(MODULE_STALL)))  # type: ignore[arg-type]
        for _ in range(3)
    ]  # 2 hold acme's turns (each ~wall_s until its sandbox is killed), 1 waits
    await wait_for(lambda: sandboxes() >= 2, timeout=15, what="acme's two sandboxes")
    with pytest.raises(openai.RateLimitError) as refused:
        await acme.fine_tuning.alpha.graders.validate(grader=EXACT)  # type: ignore[arg-type]
    said = refused.value.message
    assert refused.value.status_code == 429 and "2 run at a time, 1 more may wait" in said, said
    began = time.monotonic()
    quick = await globex.fine_tuning.alpha.graders.validate(grader=EXACT)  # type: ignore[arg-type]
    took = time.monotonic() - began
    assert quick.grader is not None and quick.grader.type == "string_check"
    assert not any(t.done() for t in slow), "globex's validate waited for acme's"  # the bound: acme still running
    print(f"globex's validate while acme held its turns: {took * 1000:.0f} ms")
    for task in slow:
        with pytest.raises(openai.BadRequestError) as bad:
            await task
        assert bad.value.param == "grader.source" and "wall-clock limit of 2.0 s" in bad.value.message


@SANDBOX
async def test_a_run_of_a_grader_that_stalls_answers_at_its_wall_limit_scored_0_and_counted(nc, gateway):
    acme = await client_for(nc, gateway, "acme")
    start_s = await asyncio.to_thread(sandbox_start_s)
    began = time.monotonic()
    ran = await acme.fine_tuning.alpha.graders.run(grader=python(CALL_STALL), model_sample="stall")  # type: ignore[arg-type]
    took = time.monotonic() - began
    assert ran.reward == 0.0 and ran.metadata.errors.unresponsive_reward_error, ran.metadata.errors
    assert "wall-clock limit of 2.0 s" in (ran.metadata.errors.message or "")
    assert took < start_s + 2.0 + 1.0 + start_s, (took, start_s)  # its check's load, then the run: limit + 1 s
    assert await wait_for(lambda: not sandbox_processes(), timeout=2, what="no sandbox left")


async def test_a_multi_grader_past_its_size_is_refused_before_anything_runs(nc, gateway):
    acme = await client_for(nc, gateway, "acme")
    many = {f"g{k}": python("def grade(sample, item):\n    return 1.0\n", f"g{k}") for k in range(40)}
    multi = {"type": "multi", "name": "m", "calculate_output": "g0", "graders": many}
    began = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        await acme.fine_tuning.alpha.graders.validate(grader=multi)  # type: ignore[arg-type]
    took = time.monotonic() - began
    assert refused.value.param == "grader.graders", refused.value.body
    assert "holds 40 graders" in refused.value.message and f"at most {MAX_GRADERS}" in refused.value.message
    print(f"a multi grader of 40 python graders refused in {took * 1000:.0f} ms")
    four = {f"s{k}": {**EXACT, "name": f"s{k}"} for k in range(4)}
    inner = {"type": "multi", "name": "i", "calculate_output": "s0", "graders": four}
    nested = {"type": "multi", "name": "n", "calculate_output": "m0", "graders": {f"m{k}": inner for k in range(5)}}
    with pytest.raises(openai.BadRequestError) as deep:
        await acme.fine_tuning.alpha.graders.validate(grader=nested)  # type: ignore[arg-type]
    assert deep.value.param == "grader.graders" and "holds 25 graders (nested ones counted)" in deep.value.message


@SANDBOX
async def test_a_requests_python_graders_share_one_budget_of_sandbox_time(nc, gateway):
    acme = await client_for(nc, gateway, "acme")
    stalls = {k: python(MODULE_STALL, k) for k in ("a", "b", "c")}
    multi = {"type": "multi", "name": "m", "calculate_output": "a + b + c", "graders": stalls}
    began = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        await acme.fine_tuning.alpha.graders.validate(grader=multi)  # type: ignore[arg-type]
    took = time.monotonic() - began
    said = refused.value.message
    assert "grader.graders.a.source" in said and "wall-clock limit of 2.0 s" in said, said
    assert "this request's 3 s of sandbox time" in said, said  # b ran into the request's budget, c never started
    assert took < 3.0 + 1.5, took
    assert await wait_for(lambda: not sandbox_processes(), timeout=2, what="no sandbox left")
