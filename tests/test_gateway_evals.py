"""OpenAI's Evals API through the gateway with OpenAI's own client, against the real stack: an eval of the capitals
with a string_check and a python grader, run against the tiny base model (its items sent in the request, rendered
through a template) and against a model fine-tuned through client.fine_tuning.jobs (its items in an uploaded file);
the fine-tuned model passes more items. The follower records the finished run without anyone reading it; output
items list; update and delete; refusals name their field; another tenant's key sees none of it."""

from __future__ import annotations

import time

import msgspec
import openai
import pytest

from schemas import names
from schemas.datasets import DatasetList, DatasetListQuery
from schemas.evals import EvalRun, run_key
from services import bus
from services.evals.service import EvalsService
from tests.conftest import wait_for, wait_nodes
from tests.qa import pairs
from tests.test_gateway import client_for, finished
from tests.test_gateway_rft import gateway, sft_hyperparameters, upload  # noqa: F401  (a fixture)
from tests.test_grpo import CAPITALS, rft_rows
from tests.test_gates import SAYS_ANSWER

NAMES_CITY = {
    "type": "python",
    "name": "names_city",
    "pass_threshold": 1.0,
    "source": 'def grade(sample, item):\n    city = item["answer"].rstrip(".").split()[-1]\n'
    '    return 1.0 if city in sample["output_text"] else 0.0\n',
}
ITEM_SCHEMA = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["question", "answer"],
}
TEMPLATE = {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]}
SAMPLING = {"temperature": 0, "max_completion_tokens": 24, "seed": 0}


@pytest.fixture
async def evals(stack, services):
    service, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(service.ready.is_set, timeout=10, what="the evals service")
    return service


def completions(model: str, source: dict, input_messages: dict = TEMPLATE) -> dict:
    return {
        "type": "completions",
        "model": model,
        "source": source,
        "input_messages": input_messages,
        "sampling_params": SAMPLING,
    }


async def stored_run(nc, tenant: str, run: str) -> EvalRun | None:
    """The run's record as the bucket holds it, read without asking the evals service (which would refresh it)."""
    kv = await nc.jetstream().key_value(names.EVALS_KV)
    entry = await kv.get(run_key(tenant, run))
    return msgspec.json.decode(entry.value, type=EvalRun) if entry.value else None


async def test_an_eval_runs_through_the_openai_client_and_the_fine_tuned_model_passes_more(
    nc,
    evals,
    gateway,  # noqa: F811
    agents,
    tmp_path,
):
    started = time.monotonic()
    agents.start("cpu-node", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    client, other = await client_for(nc, gateway, "acme"), await client_for(nc, gateway, "globex")
    sft_file = await upload(client, tmp_path / "qa.jsonl", pairs())
    rows = [{**row, "question": q} for row, (q, _) in zip(rft_rows(), CAPITALS)]  # rft rows: they upload as files
    items_file = await upload(client, tmp_path / "capitals.jsonl", rows)
    sft = await client.fine_tuning.jobs.create(
        model="tiny",
        training_file=sft_file,
        suffix="capitals",
        seed=42,
        method={"type": "supervised", "supervised": {"hyperparameters": sft_hyperparameters()}},
    )
    e = await client.evals.create(
        name="capitals",
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA, "include_sample_schema": True},
        testing_criteria=[SAYS_ANSWER, NAMES_CITY],  # type: ignore[list-item]
        metadata={"team": "geo"},
    )
    assert e.id.startswith("eval_") and e.name == "capitals" and e.metadata == {"team": "geo"}
    assert [c.name for c in e.testing_criteria] == ["says_answer", "names_city"]
    assert set(e.data_source_config.schema_["properties"]) == {"item", "sample"}
    await refusals(client, e.id)

    content = [{"item": {"question": q, "answer": a}} for q, a in CAPITALS]
    on_base = await client.evals.runs.create(
        e.id, name="base", data_source=completions("tiny", {"type": "file_content", "content": content})
    )
    assert on_base.status in ("queued", "in_progress") and on_base.model == "tiny"
    sft = await finished(client, sft.id, 180)
    assert sft.status == "succeeded", (sft.error, agents.log("cpu-node")[-3000:])
    tuned = sft.fine_tuned_model
    assert tuned

    async def listed() -> bool:
        return tuned in [m.id for m in (await client.models.list()).data]

    await wait_for(listed, 30, what="the fine-tuned model listed")
    by_reference = {"type": "item_reference", "item_reference": "item.messages"}
    on_tuned = await client.evals.runs.create(
        e.id, name="tuned", data_source=completions(tuned, {"type": "file_id", "id": items_file}, by_reference)
    )

    async def recorded():  # finished by the follower: nobody reads it through the service meanwhile
        r = await stored_run(nc, "acme", on_tuned.id)
        return r if r is not None and r.state in ("completed", "failed", "canceled") else None

    stored = await wait_for(recorded, 120, interval=0.5, what="the fine-tuned run recorded as ended")
    assert stored.state == "completed" and stored.summary is not None, (stored.message, agents.log("cpu-node")[-3000:])
    runs = {r.name: await ended(client, e.id, r.id) for r in (on_base, on_tuned)}
    passed = {name: r.result_counts.passed for name, r in runs.items()}
    print(f"eval through the gateway: passed {passed} of {len(CAPITALS)}; {time.monotonic() - started:.0f} s")
    assert passed["tuned"] > passed["base"] and passed["tuned"] >= len(CAPITALS) // 2, passed
    for r in runs.values():
        assert r.status == "completed" and r.result_counts.total == len(CAPITALS)
        assert {c.testing_criteria for c in r.per_testing_criteria_results} == {"says_answer", "names_city"}
    await output_items(client, e.id, runs["tuned"].id)
    listed_runs = [r.id async for r in client.evals.runs.list(e.id, order="asc")]
    assert listed_runs == [on_base.id, on_tuned.id]

    await isolation(other, e.id, on_tuned.id)
    updated = await client.evals.update(e.id, name="capitals v2", metadata={"team": "maps"})
    assert updated.name == "capitals v2" and (await client.evals.retrieve(e.id)).metadata == {"team": "maps"}
    assert [x.id async for x in client.evals.list(limit=1)] == [e.id]
    assert (await client.evals.runs.delete(on_base.id, eval_id=e.id)).deleted
    assert [r.id async for r in client.evals.runs.list(e.id)] == [on_tuned.id]
    assert (await client.evals.delete(e.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await client.evals.retrieve(e.id)
    kept = await bus.request(nc, names.datasets_api("acme").list, DatasetListQuery(), DatasetList)
    assert not [d.name for d in kept.datasets if d.name.startswith("evalitems_")], kept  # the runs' items went too


async def ended(client: openai.AsyncOpenAI, eval_id: str, run_id: str):
    async def done():
        r = await client.evals.runs.retrieve(run_id, eval_id=eval_id)
        return r if r.status in ("completed", "failed", "canceled") else None

    return await wait_for(done, 120, interval=0.5, what=f"eval run {run_id}")


async def output_items(client: openai.AsyncOpenAI, eval_id: str, run_id: str) -> None:
    items = [i async for i in client.evals.runs.output_items.list(run_id, eval_id=eval_id, limit=3)]
    assert len(items) == len(CAPITALS) and [i.datasource_item_id for i in items] == list(range(len(CAPITALS)))
    first = items[0]
    assert first.datasource_item["answer"] == CAPITALS[0][1] and first.sample.input[-1].content == CAPITALS[0][0]
    assert first.sample.output[0].content and {r.name for r in first.results} == {"says_answer", "names_city"}
    assert first.status in ("pass", "fail") and first.sample.max_completion_tokens == 24
    again = await client.evals.runs.output_items.retrieve(first.id, eval_id=eval_id, run_id=run_id)
    assert again.id == first.id and [r.model_dump() for r in again.results] == [r.model_dump() for r in first.results]
    passing = [i async for i in client.evals.runs.output_items.list(run_id, eval_id=eval_id, status="pass")]
    assert passing and all(i.status == "pass" for i in passing)


async def isolation(other: openai.AsyncOpenAI, eval_id: str, run_id: str) -> None:
    """Another tenant's key: a 404 for each of them, and empty lists."""
    assert [x async for x in other.evals.list()] == []
    for ask in (
        other.evals.retrieve(eval_id),
        other.evals.runs.retrieve(run_id, eval_id=eval_id),
        other.evals.runs.output_items.list(run_id, eval_id=eval_id),
        other.evals.runs.cancel(run_id, eval_id=eval_id),
        other.evals.delete(eval_id),
    ):
        with pytest.raises(openai.NotFoundError):
            await ask


async def refusals(client: openai.AsyncOpenAI, eval_id: str) -> None:
    """Each refused in OpenAI's error shape, `param` naming the field."""
    content = {"type": "file_content", "content": [{"item": {"question": "q", "answer": "a"}}]}
    for ask, param in (
        (
            client.evals.create(
                data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA},
                testing_criteria=[SAYS_ANSWER, {**NAMES_CITY, "source": " "}],  # type: ignore[list-item]
            ),
            "testing_criteria[1].source",
        ),
        (
            client.evals.create(
                data_source_config={"type": "stored_completions"},
                testing_criteria=[SAYS_ANSWER],  # type: ignore[list-item]
            ),
            "data_source_config.type",
        ),
        (
            client.evals.runs.create(eval_id, data_source={"type": "jsonl", "source": content}),
            "data_source.source.content[0].sample",  # a jsonl row carries its sample
        ),
        (client.evals.runs.create(eval_id, data_source=completions("nope", content)), "data_source.model"),
        (
            client.evals.runs.create(
                eval_id,
                data_source=completions(
                    "tiny", content, {"type": "template", "template": [{"role": "user", "content": "{{item.q}}"}]}
                ),
            ),
            "data_source.input_messages.template[0].content",
        ),
        (
            client.evals.runs.create(
                eval_id, data_source={**completions("tiny", content), "sampling_params": {"top_p": 0.5}}
            ),
            "data_source.sampling_params.top_p",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await ask
        assert e.value.param == param, (param, e.value.message)
