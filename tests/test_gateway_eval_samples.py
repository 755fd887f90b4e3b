"""OpenAI's `jsonl` eval runs through the gateway with OpenAI's own client: samples made elsewhere (some right, some
half right, some wrong) graded as sent by an eval's string_check and python grader (in the sandbox) in the evals
service, nothing sampled: the run completes with output items, result_counts and per_testing_criteria_results as a
completions run's, stored as any run's (`via` samples). Rows sent in the request and rows in a file of the tenant's;
a malformed row is refused naming it, nothing stored; another tenant's key finds neither the eval nor the file."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

from schemas.evals import SAMPLES
from services.artifacts.service import ArtifactService
from services.evals import samples
from services.evals.runs import RunError
from services.evals.service import EvalsService
from services.gateway.evals import mapping as evals_map
from services.gateway.app import Gateway
from services.graders import GraderContext
from tests.conftest import wait_for
from tests.test_gateway import client_for
from tests.test_gateway_evals import ITEM_SCHEMA, NAMES_CITY, SAYS_ANSWER, ended, stored_run
from tests.test_gateway_graders import SANDBOX
from tests.test_grpo import CAPITALS


def sample(n: int, answer: str) -> str:
    """Rows 0-3 say the answer (both graders pass), 4-5 name the city only (names_city alone), 6-7 neither."""
    return answer if n < 4 else f"{answer.rstrip('.').split()[-1]}, I think." if n < 6 else "No idea."


ROWS = [
    {"item": {"question": q, "answer": a}, "sample": {"output_text": sample(n, a)}} for n, (q, a) in enumerate(CAPITALS)
]

CONFIG: Any = {"type": "custom", "item_schema": ITEM_SCHEMA, "include_sample_schema": True}


@pytest.fixture
async def graded(nc, services):
    """The artifact service (files) and the evals service, which grades runs of samples."""
    await services.start(lambda c: ArtifactService(c))
    service, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(service.ready.is_set, timeout=10, what="the evals service")
    gw = Gateway(nc, {}, port=0)
    await gw.start()
    yield gw
    await gw.close()


def jsonl(source: dict) -> Any:
    return {"type": "jsonl", "source": source}


def content(rows: list[dict]) -> dict:
    return {"type": "file_content", "content": rows}


@SANDBOX  # the python grader runs in the evals service's sandbox
async def test_a_jsonl_run_grades_samples_made_elsewhere_through_the_openai_client(nc, graded, tmp_path):
    started = time.monotonic()
    client, other = await client_for(nc, graded, "acme"), await client_for(nc, graded, "globex")
    e = await client.evals.create(
        name="capitals, answered elsewhere", data_source_config=CONFIG, testing_criteria=[SAYS_ANSWER, NAMES_CITY]
    )
    file_rows = [{"messages": [{"role": "user", "content": r["item"]["question"]}], **r["item"]} for r in ROWS[:2]]
    bare = await upload(client, tmp_path / "bare.jsonl", file_rows)
    await refusals(client, e.id, bare)
    assert [r async for r in client.evals.runs.list(e.id)] == []  # nothing of the refused runs stored

    run = await client.evals.runs.create(e.id, name="elsewhere", data_source=jsonl(content(ROWS)))
    assert run.status in ("in_progress", "completed") and run.data_source.type == "jsonl"
    done = await ended(client, e.id, run.id)
    assert done.status == "completed", done.error
    assert done.result_counts.model_dump() == {"total": 8, "passed": 4, "failed": 4, "errored": 0}
    by_criterion = {c.testing_criteria: (c.passed, c.failed) for c in done.per_testing_criteria_results}
    assert by_criterion == {"says_answer": (4, 4), "names_city": (6, 2)}
    await output_items(client, e.id, run.id)
    stored = await stored_run(nc, "acme", run.id)
    assert stored is not None and stored.via == SAMPLES and stored.results and stored.summary is not None

    with_samples = [{**row, "sample": {"output_text": sample(n + 4, row["answer"])}} for n, row in enumerate(file_rows)]
    carried = await upload(client, tmp_path / "samples.jsonl", with_samples)  # rft rows, each with its sample
    from_file = await client.evals.runs.create(e.id, data_source=jsonl({"type": "file_id", "id": carried}))
    done = await ended(client, e.id, from_file.id)
    assert done.status == "completed" and done.result_counts.total == 2 and done.result_counts.passed == 0, done
    assert {c.testing_criteria: c.passed for c in done.per_testing_criteria_results} == {
        "says_answer": 0,
        "names_city": 2,
    }

    await isolation(other, e.id, run.id, carried)
    assert (await client.evals.runs.delete(run.id, eval_id=e.id)).deleted
    assert [r.id async for r in client.evals.runs.list(e.id)] == [from_file.id]
    print(f"jsonl runs through the gateway: {time.monotonic() - started:.1f} s")


async def upload(client: openai.AsyncOpenAI, path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(path, "rb") as f:
        return (await client.files.create(file=f, purpose="fine-tune")).id


async def output_items(client: openai.AsyncOpenAI, eval_id: str, run_id: str) -> None:
    items = [i async for i in client.evals.runs.output_items.list(run_id, eval_id=eval_id, limit=3)]
    assert [i.datasource_item_id for i in items] == list(range(len(CAPITALS)))
    assert [i.status for i in items] == ["pass"] * 4 + ["fail"] * 4
    scores = [{r.name: r.score for r in i.results} for i in items]
    assert scores[0] == {"says_answer": 1.0, "names_city": 1.0} and scores[4] == {"says_answer": 0.0, "names_city": 1.0}
    assert scores[7] == {"says_answer": 0.0, "names_city": 0.0}
    assert items[4].sample.output[0].content == "Berlin, I think." and items[4].datasource_item == ROWS[4]["item"]
    passing = [i.id async for i in client.evals.runs.output_items.list(run_id, eval_id=eval_id, status="pass")]
    assert passing == [i.id for i in items[:4]]


async def refusals(client: openai.AsyncOpenAI, eval_id: str, bare_file: str) -> None:
    """Each refused in OpenAI's error shape, `param` naming the row's field (or the file, saying the line)."""
    no_sample = [*ROWS[:3], {"item": ROWS[3]["item"]}]
    no_answer = [*ROWS[:2], {**ROWS[2], "item": {"question": "q"}}]
    not_text = [{**ROWS[0], "sample": {"output_text": 3}}]
    for data_source, param, said in (
        (jsonl(content(no_sample)), "data_source.source.content[3].sample", "its sample"),
        (jsonl(content(no_answer)), "data_source.source.content[2].item.answer", "item_schema requires"),
        (jsonl(content(not_text)), "data_source.source.content[0].sample.output_text", "as a string"),
        ({**jsonl(content(ROWS)), "model": "tiny"}, "data_source.model", "no model answers them"),
        (jsonl({"type": "file_id", "id": bare_file}), "data_source.source.id", "line 1 of"),
        (jsonl({"type": "stored_completions"}), "data_source.source", "file_content"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await client.evals.runs.create(eval_id, data_source=data_source)  # type: ignore[arg-type]
        assert e.value.param == param and said in e.value.message, (param, e.value.message)


async def isolation(other: openai.AsyncOpenAI, eval_id: str, run_id: str, file_id: str) -> None:
    """Another tenant's key: the eval, its run and its items are not found, nor the file, in its own eval."""
    for ask in (
        other.evals.runs.create(eval_id, data_source=jsonl(content(ROWS))),
        other.evals.runs.retrieve(run_id, eval_id=eval_id),
        other.evals.runs.output_items.list(run_id, eval_id=eval_id),
    ):
        with pytest.raises(openai.NotFoundError):
            await ask
    own = await other.evals.create(data_source_config=CONFIG, testing_criteria=[SAYS_ANSWER])  # type: ignore[list-item]
    with pytest.raises(openai.NotFoundError) as e:
        await other.evals.runs.create(own.id, data_source=jsonl({"type": "file_id", "id": file_id}))
    assert e.value.param == "data_source.source.id", e.value.message


async def test_a_grader_the_evals_service_may_not_run_refuses_the_run_naming_the_flag():
    criteria = evals_map.criteria([SAYS_ANSWER, NAMES_CITY])
    with pytest.raises(RunError) as e:
        await samples.runnable(criteria, GraderContext(python_graders="off", command="jetlora scheduler"))
    assert e.value.field == "criteria.1.grader.type" and "jetlora scheduler --python-graders off" in str(e.value)
