"""Evals through the native API, for real: an eval of the capitals (a string_check for the answer and a python grader,
both sandboxed or not as the node allows) run against the tiny base model and against an adapter trained a little on
those answers, each run placed as a job, sampled and graded by the trainer; the adapter scores higher, every interval
holds its mean, the per-item outputs are read back, and `adapters show` lists the version's scores. Refusals name
their field; another tenant sees none of it."""

from __future__ import annotations

import time

import pytest

from schemas import names
from schemas.evals import EvalCreate, EvalReply, ItemsPage, ItemsQuery, RunQuery, RunReply, RunRequest
from schemas.jobs import Accepted, Error
from services import bus
from services.cli.evals import criterion, version_scores
from services.evals.service import EvalsService
from services.transfer.sender import upload_dataset
from tests.conftest import submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs
from tests.test_dataset_formats import data_file
from tests.test_grpo import CAPITALS, rft_rows

SAYS_ANSWER = '{"type": "string_check", "name": "says_answer", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "ilike"}'
NAMES_CITY = (
    '{"type": "python", "name": "names_city", "pass_threshold": 1.0, "source": '
    '"def grade(sample, item):\\n    return 1.0 if item[\\"answer\\"].rstrip(\\".\\").split()[-1] in '
    'sample[\\"output_text\\"] else 0.0\\n"}'
)
API = names.evals_api()


@pytest.fixture
async def evals(stack, services):
    service, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(service.ready.is_set, timeout=10, what="the evals service")
    return service


async def run_until_done(nc, request: RunRequest):
    placed = await bus.request(nc, API.run, request, RunReply | Error)
    assert isinstance(placed, RunReply), placed

    async def ended():
        r = (await bus.request(nc, API.run_show, RunQuery(run=placed.run.id), RunReply)).run
        return r if r.state in ("completed", "failed", "canceled") else None

    run = await wait_for(ended, timeout=120, interval=0.5, what=f"eval run {placed.run.id}")
    assert run.state == "completed", run.message
    return run


async def test_an_eval_scores_the_adapter_above_the_base(nc, evals, agents, tiny_model, tmp_path):
    started = time.monotonic()
    agents.start("cpu", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    await upload_dataset(nc, "capitals-rft", data_file(tmp_path / "rft.jsonl", "rft", rft_rows()).path)
    base = {"model": "tiny", "base_dir": str(tiny_model), "accelerator": "cpu"}
    train = {"max_steps": 60, "learning_rate": 0.01, "batch_size": 1, "max_seq_length": 128, "warmup_steps": 0}
    sft = await submit(nc, {**base, "data": pairs(), "register": {"name": "capitals"}, "train": train})
    assert isinstance(sft, Accepted), sft
    await refusals(nc)
    create = EvalCreate(
        name="capitals", dataset="capitals-rft", criteria=[criterion(SAYS_ANSWER), criterion(NAMES_CITY)]
    )
    create.sampling.max_tokens = 24
    assert isinstance(await bus.request(nc, API.create, create, EvalReply | Error), EvalReply)
    done = await wait_state(nc, sft.job, ("succeeded", "failed"), timeout=120)
    assert done.state == "succeeded", (done.message, agents.log("cpu")[-3000:])
    await wait_for(lambda: registered(nc), timeout=30, what="the adapter's registration")

    where = {"eval": "capitals", "base_dir": str(tiny_model), "accelerator": "cpu"}
    on_base = await run_until_done(nc, RunRequest(**where, base_model="tiny"))
    on_adapter = await run_until_done(nc, RunRequest(**where, adapter="capitals", version=1))
    scores = {r.model: {g.name: g for g in r.summary.graders} for r in (on_base, on_adapter)}
    print(
        f"eval scores: { {m: {n: round(g.mean, 2) for n, g in s.items()} for m, s in scores.items()} }; "
        f"{time.monotonic() - started:.0f} s"
    )
    base_says, adapter_says = scores["tiny"]["says_answer"], scores["capitals@1"]["says_answer"]
    assert base_says.mean <= 0.125 and adapter_says.mean >= 0.5, scores
    for g in (*scores["tiny"].values(), *scores["capitals@1"].values()):
        assert g.low <= g.mean <= g.high and g.passed + g.failed == len(CAPITALS), g
    assert scores["capitals@1"]["names_city"].mean >= base_says.mean

    page = await bus.request(nc, API.items, ItemsQuery(run=on_adapter.id, limit=5), ItemsPage | Error)
    assert isinstance(page, ItemsPage) and len(page.items) == 5 and page.has_more, page
    first = page.items[0]
    assert first.input[-1]["content"] == CAPITALS[0][0] and first.item["answer"] == CAPITALS[0][1]
    assert len(first.outputs) == 1 and set(first.scores) == {"says_answer", "names_city"}
    rest = await bus.request(nc, API.items, ItemsQuery(run=on_adapter.id, after=4), ItemsPage)
    assert [i.index for i in rest.items] == [5, 6, 7] and not rest.has_more

    shown = "\n".join(await version_scores(nc, None, "capitals"))
    assert "@1" in shown and "says_answer" in shown and on_adapter.id in shown, shown
    other = names.evals_api("acme")
    assert isinstance(await bus.request(nc, other.show, {"name": "capitals"}, EvalReply | Error), Error)
    assert isinstance(await bus.request(nc, other.run_show, RunQuery(run=on_adapter.id), RunReply | Error), Error)


async def registered(nc) -> bool:
    from schemas.registry import AdapterQuery, AdapterReply

    reply = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name="capitals"), AdapterReply | Error)
    return isinstance(reply, AdapterReply) and bool(reply.versions)


async def refusals(nc) -> None:
    """Each refused naming the field it is about."""
    for request, subject, field in (
        (EvalCreate(name="x", dataset="nope", criteria=[criterion(SAYS_ANSWER)]), API.create, "dataset"),
        (
            {
                "name": "x",
                "dataset": "capitals-rft",
                "criteria": [
                    {
                        "grader": {
                            "type": "string_check",
                            "name": "a",
                            "input": "{{sample.output_txt}}",
                            "reference": "b",
                            "operation": "eq",
                        }
                    }
                ],
            },
            API.create,
            "criteria.0.grader.input",
        ),
        (
            EvalCreate(name="x", criteria=[criterion(SAYS_ANSWER), criterion(SAYS_ANSWER)]),
            API.create,
            "criteria.1.grader.name",
        ),
        (RunRequest(eval="nope", base_model="tiny", base_dir="/m"), API.run, "eval"),
    ):
        reply = await bus.request(nc, subject, request, EvalReply | RunReply | Error)
        assert isinstance(reply, Error) and reply.field == field, (field, reply)
    assert isinstance(
        await bus.request(nc, API.create, EvalCreate(name="y", criteria=[criterion(SAYS_ANSWER)]), EvalReply | Error),
        EvalReply,
    )
    for request, field in (
        (RunRequest(eval="y", base_model="tiny", base_dir="/m"), "dataset"),
        (RunRequest(eval="y", adapter="nobody", base_dir="/m"), "adapter"),
        (RunRequest(eval="y", base_dir="/m"), "adapter"),
    ):
        reply = await bus.request(nc, API.run, request, RunReply | Error)
        assert isinstance(reply, Error) and reply.field == field, (field, reply)
