"""The gateway's graders endpoints, called by OpenAI's own client as two tenants: graders.validate (a good grader
back as sent; a bad one a 400 whose `param` names the field) and graders.run (string_check, a python grader in the
sandbox, multi), with OpenAI's response shape."""

from __future__ import annotations

import asyncio

import openai
import pytest

from services.gateway.app import Gateway
from services.graders import GraderContext, status
from tests.test_gateway import client_for

SANDBOX = pytest.mark.skipif(not status().isolated, reason=f"no sandbox here: {status().why_not}")
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_json.city}}",
    "reference": "{{item.city}}",
    "operation": "eq",
}
PYTHON = {
    "type": "python",
    "name": "length",
    "source": "def grade(sample, item):\n    return min(1.0, len(sample['output_text']) / item['max_len'])\n",
}


@pytest.fixture
async def gateway(nc):
    gw = Gateway(nc, {}, port=0, graders=GraderContext(wall_s=5.0))
    await gw.start()
    yield gw
    await gw.close()


async def test_validate_returns_a_good_grader_and_refuses_a_bad_one_naming_the_field(nc, gateway):
    acme, globex = await client_for(nc, gateway, "acme"), await client_for(nc, gateway, "globex")
    good = await acme.fine_tuning.alpha.graders.validate(grader=EXACT)
    assert good.grader is not None and good.grader.type == "string_check" and good.grader.reference == "{{item.city}}"
    bad = {
        "type": "multi",
        "name": "m",
        "calculate_output": "exact + unknown",
        "graders": {"exact": EXACT, "sim": {**EXACT, "type": "text_similarity", "evaluation_metric": "cosine"}},
    }
    with pytest.raises(openai.BadRequestError) as refused:
        await globex.fine_tuning.alpha.graders.validate(grader=bad)  # type: ignore[arg-type]
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == "grader.graders.sim.operation", error
    assert "unknown field" in error["message"] and "grader.graders.sim.evaluation_metric" not in error["message"]
    assert "grader.calculate_output: unknown name 'unknown'" in error["message"]  # every error at once
    fixed = {**bad, "graders": {"exact": EXACT, "sim": {**bad["graders"]["sim"], "operation": None}}}
    del fixed["graders"]["sim"]["operation"]
    with pytest.raises(openai.BadRequestError) as cosine:
        await globex.fine_tuning.alpha.graders.validate(grader=fixed)  # type: ignore[arg-type]
    assert cosine.value.body["param"] == "grader.calculate_output"
    assert "grader.graders.sim.evaluation_metric: cosine needs an embedding model" in cosine.value.body["message"]
    with pytest.raises(openai.BadRequestError) as judge:
        model = {"type": "score_model", "name": "j", "model": "m", "input": [{"role": "user", "content": "x"}]}
        await acme.fine_tuning.alpha.graders.validate(grader=model)  # type: ignore[arg-type]
    assert judge.value.body["param"] == "grader.model" and "judge engine" in judge.value.body["message"]


async def test_run_string_check_as_two_tenants(nc, gateway):
    acme, globex = await client_for(nc, gateway, "acme"), await client_for(nc, gateway, "globex")
    right, wrong = await asyncio.gather(
        acme.fine_tuning.alpha.graders.run(grader=EXACT, model_sample='{"city": "Paris"}', item={"city": "Paris"}),
        globex.fine_tuning.alpha.graders.run(grader=EXACT, model_sample='{"city": "Rome"}', item={"city": "Paris"}),
    )
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    assert right.metadata.name == "exact" and right.metadata.type == "string_check"
    assert right.metadata.execution_time >= 0 and not any(
        v for k, v in right.metadata.errors.model_dump().items() if isinstance(v, bool)
    )
    missing = await acme.fine_tuning.alpha.graders.run(grader=EXACT, model_sample="not json", item={"city": "Paris"})
    assert missing.reward == 0.0 and missing.metadata.errors.invalid_variable_error
    with pytest.raises(openai.BadRequestError) as no_sample:
        await acme.fine_tuning.alpha.graders.run(grader=EXACT, model_sample=None)  # type: ignore[arg-type]
    assert no_sample.value.body["param"] == "model_sample"


async def test_a_wrong_key_is_refused(gateway):
    stranger = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="jl-x-y", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await stranger.fine_tuning.alpha.graders.validate(grader=EXACT)  # type: ignore[arg-type]


@SANDBOX
async def test_run_a_python_grader_in_the_sandbox_and_a_multi(nc, gateway):
    acme, globex = await client_for(nc, gateway, "acme"), await client_for(nc, gateway, "globex")
    ran = await acme.fine_tuning.alpha.graders.run(grader=PYTHON, model_sample="abcde", item={"max_len": 10})
    assert ran.reward == 0.5 and ran.metadata.type == "python"
    broken = {**PYTHON, "source": "import os\ndef grade(sample, item):\n    return float(os.environ['HOME'])\n"}
    failed = await globex.fine_tuning.alpha.graders.run(grader=broken, model_sample="x")  # type: ignore[arg-type]
    assert failed.reward == 0.0 and failed.metadata.errors.python_grader_runtime_error
    assert "KeyError" in (failed.metadata.errors.python_grader_runtime_error_details or "")
    multi = {
        "type": "multi",
        "name": "overall",
        "calculate_output": "0.75 * exact + 0.25 * length",
        "graders": {"exact": EXACT, "length": PYTHON},
    }
    both = await globex.fine_tuning.alpha.graders.run(
        grader=multi,  # type: ignore[arg-type]
        model_sample='{"city": "Paris"}',
        item={"city": "Paris", "max_len": 34},
    )
    assert both.reward == pytest.approx(0.75 + 0.25 * 0.5)
    assert both.sub_rewards == {"exact": 1.0, "length": 0.5} and both.metadata.type == "multi"
