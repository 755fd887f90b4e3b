"""Graders and items refused at the door, with OpenAI's own client against the real stack (scheduler, artifact
service, evals service): a reinforcement job's grader and an eval's testing criteria checked as /graders/validate
checks one (a python grader that does not compile, or defines no grade(), in the sandbox), their `{{item.x}}`
templates resolved against the training file's first rows or the eval's item_schema; the item_schema checked as
JSON Schema (Draft 2020-12) at create, and each item against it at a run, naming the row and the path in it; a file
of purpose "evals" (OpenAI's item/sample rows) uploaded, listed as such, run by a jsonl and a completions run, and
refused as training data. Nothing refused is queued or stored."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from schemas import names, nats_subjects
from schemas.datasets import DatasetList, DatasetListQuery
from services import bus
from services.evals.service import EvalsService
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.graders import GraderContext
from tests.conftest import wait_for
from tests.test_gateway import client_for
from tests.test_gateway_evals import ITEM_SCHEMA, NAMES_CITY, ended
from tests.test_gateway_graders import SANDBOX
from tests.test_gates import SAYS_ANSWER
from tests.test_grpo import CAPITALS, SAYS_PARIS, rft_rows

NO_COMPILE = {"type": "python", "name": "broken", "source": "def grade(sample, item)\n    return 1.0\n"}
NO_GRADE = {"type": "python", "name": "nameless", "source": "def score(sample, item):\n    return 1.0\n"}
ROWS = [{"item": {"question": q, "answer": a}, "sample": {"output_text": a}} for q, a in CAPITALS]
CONFIG: Any = {"type": "custom", "item_schema": ITEM_SCHEMA, "include_sample_schema": True}


@pytest.fixture
async def door(stack, nc, services):
    service, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(service.ready.is_set, timeout=10, what="the evals service")
    await nc.jetstream().purge_stream(nats_subjects.kv(names.GATEWAY_JOBS_KV).stream)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", "/models/tiny")}, port=0, graders=GraderContext(wall_s=5.0))
    await gw.start()
    yield gw
    await gw.close()


async def upload(client: openai.AsyncOpenAI, path, rows: list[dict], purpose: str = "fine-tune") -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(path, "rb") as f:
        return (await client.files.create(file=f, purpose=purpose)).id  # type: ignore[arg-type]


def reinforcement(grader: dict) -> Any:
    return {"type": "reinforcement", "reinforcement": {"grader": grader}}


async def refused(ask, param: str, said: str = "") -> str:
    with pytest.raises(openai.BadRequestError) as e:
        await ask
    assert e.value.param == param and said in e.value.message, (param, e.value.param, e.value.message)
    return e.value.message


@SANDBOX
async def test_a_reinforcement_grader_is_checked_at_jobs_create(nc, door, tmp_path):
    client = await client_for(nc, door, "acme")
    rft = await upload(client, tmp_path / "rft.jsonl", rft_rows())
    rows_without_answer = [
        {k: v for k, v in r.items() if k != "answer"} if n == 1 else r for n, r in enumerate(rft_rows())
    ]
    gappy = await upload(client, tmp_path / "gappy.jsonl", rows_without_answer)
    evals_file = await upload(client, tmp_path / "evals.jsonl", ROWS, purpose="evals")
    create = client.fine_tuning.jobs.create
    g = "method.reinforcement.grader"
    await refused(create(model="tiny", training_file=rft, method=reinforcement(NO_COMPILE)), f"{g}.source", "line 1")
    await refused(create(model="tiny", training_file=rft, method=reinforcement(NO_GRADE)), f"{g}.source", "grade")
    multi = {"type": "multi", "name": "both", "graders": {"a": SAYS_PARIS, "b": NO_COMPILE}, "calculate_output": "a"}
    await refused(create(model="tiny", training_file=rft, method=reinforcement(multi)), f"{g}.graders.b.source")
    missing = {**SAYS_ANSWER, "reference": "{{item.missing_field}}"}
    said = await refused(create(model="tiny", training_file=rft, method=reinforcement(missing)), f"{g}.reference")
    assert "row 1 of training_file" in said and "'missing_field'" in said, said
    said = await refused(
        create(model="tiny", training_file=rft, validation_file=gappy, method=reinforcement(SAYS_ANSWER)),
        f"{g}.reference",
    )
    assert "row 2 of validation_file" in said and "'answer'" in said, said
    await refused(create(model="tiny", training_file=evals_file), "training_file", "purpose 'evals'")
    assert (await client.fine_tuning.jobs.list()).data == []  # nothing of it queued

    names_it = {
        "type": "python",
        "name": "n",
        "source": "def grade(sample, item):\n    return float(item['answer'] in sample['output_text'])\n",
    }
    good = {"type": "multi", "name": "both", "graders": {"a": SAYS_ANSWER, "b": names_it}, "calculate_output": "a * b"}
    job = await create(model="tiny", training_file=rft, validation_file=rft, method=reinforcement(good))
    assert job.method.type == "reinforcement" and job.status in ("queued", "running")
    await client.fine_tuning.jobs.cancel(job.id)


@SANDBOX
async def test_eval_criteria_and_item_schema_are_checked_at_evals_create(nc, door):
    client = await client_for(nc, door, "acme")
    create = client.evals.create
    for criteria, param, said in (
        ([SAYS_ANSWER, NO_COMPILE], "testing_criteria[1].source", "line 1"),
        ([SAYS_ANSWER, {**NAMES_CITY, "source": "x = 1\n"}], "testing_criteria[1].source", "grade"),
        ([{**SAYS_ANSWER, "reference": "{{item.missing_field}}"}], "testing_criteria[0].reference", "missing_field"),
    ):
        await refused(create(data_source_config=CONFIG, testing_criteria=criteria), param, said)
    for schema, param, said in (
        ({"required": 5}, "data_source_config.item_schema.required", "not of type 'array'"),
        ({"properties": {"answer": {"type": "strin"}}}, "data_source_config.item_schema.properties.answer.type", ""),
        ({"$ref": "https://example.com/item.json"}, "data_source_config.item_schema.$ref", "nothing is fetched"),
        ({"$defs": {}, "$ref": "#/$defs/item"}, "data_source_config.item_schema.$ref", "names nothing"),
    ):
        config = {"type": "custom", "item_schema": schema}
        await refused(create(data_source_config=config, testing_criteria=[SAYS_PARIS]), param, said)
    nested = {
        "type": "object",
        "properties": {"answer": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
    deep = {**SAYS_ANSWER, "reference": "{{item.answer.town}}"}
    await refused(
        create(data_source_config={"type": "custom", "item_schema": nested}, testing_criteria=[deep]),
        "testing_criteria[0].reference",
        "'town'",
    )
    assert [e async for e in client.evals.list()] == []  # nothing of it stored
    open_schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "additionalProperties": True}
    e = await create(
        data_source_config={"type": "custom", "item_schema": open_schema},
        testing_criteria=[{**SAYS_ANSWER, "reference": "{{item.anything}}"}],  # declared open: any key may be there
    )
    assert e.id.startswith("eval_")
    e = await create(data_source_config=CONFIG, testing_criteria=[SAYS_ANSWER, NAMES_CITY])
    assert [c.name for c in e.testing_criteria] == ["says_answer", "names_city"]


async def test_items_are_checked_against_the_item_schema_and_evals_files_run(nc, door, tmp_path):
    client = await client_for(nc, door, "acme")
    schema = {
        **ITEM_SCHEMA,
        "properties": {**ITEM_SCHEMA["properties"], "tags": {"type": "array", "items": {"type": "string"}}},
    }
    e = await client.evals.create(
        data_source_config={"type": "custom", "item_schema": schema, "include_sample_schema": True},
        testing_criteria=[SAYS_ANSWER],
    )
    evals_file = await upload(client, tmp_path / "evals.jsonl", ROWS, purpose="evals")
    shown = await client.files.retrieve(evals_file)
    assert shown.purpose == "evals" and shown.bytes > 0
    assert [f.id async for f in client.files.list(purpose="evals")] == [evals_file]
    assert [f.id async for f in client.files.list(purpose="fine-tune")] == []
    bad_rows = [ROWS[0], {**ROWS[1], "item": {**ROWS[1]["item"], "tags": ["a", 3]}}]
    bad_file = await upload(client, tmp_path / "bad.jsonl", bad_rows, purpose="evals")

    def jsonl(source: dict) -> Any:
        return {"type": "jsonl", "source": source}

    content = {"type": "file_content", "content": bad_rows}
    runs = client.evals.runs
    await refused(runs.create(e.id, data_source=jsonl(content)), "data_source.source.content[1].item.tags[1]", "string")
    said = await refused(
        runs.create(e.id, data_source=jsonl({"type": "file_id", "id": bad_file})), "data_source.source.id"
    )
    assert "line 2 of" in said and "item.tags[1]" in said, said
    no_answer = {"type": "file_content", "content": [{"item": {"question": "q"}}]}
    template = {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]}
    completions = {"type": "completions", "model": "tiny", "input_messages": template}
    await refused(
        runs.create(e.id, data_source={**completions, "source": no_answer}), "data_source.source.content[0].item.answer"
    )
    assert [r async for r in runs.list(e.id)] == []

    graded = await runs.create(e.id, data_source=jsonl({"type": "file_id", "id": evals_file}))
    done = await ended(client, e.id, graded.id)
    assert done.status == "completed" and done.result_counts.total == len(ROWS) == done.result_counts.passed, done
    sampled = await runs.create(e.id, data_source={**completions, "source": {"type": "file_id", "id": evals_file}})
    assert sampled.status in ("queued", "in_progress") and sampled.data_source.source.id == evals_file
    await runs.cancel(sampled.id, eval_id=e.id)
    kept = await bus.request(nc, names.datasets_api("acme").list, DatasetListQuery(), DatasetList)
    items = [d for d in kept.datasets if d.name.startswith("evalitems_")]
    assert len(items) == 1 and items[0].stats.rows == len(ROWS), kept  # the completions run's items, from the file
