"""The OpenAI-compatible gateway, driven by OpenAI's own Python client against a real stack: a file uploaded and
trained on by a real CPU trainer, its events and checkpoints listed; pause, resume and cancel; bad input refused
naming the field; a wrong key refused and one tenant unable to see another's files or jobs."""

from __future__ import annotations

import csv
import io
import json

import openai
import pytest

from schemas import names, nats_subjects
from schemas.jobs import Error
from schemas.registry import AdapterQuery, AdapterReply
from services import bus
from services.gateway.app import Gateway
from services.gateway.keys import KeyStore, new_key
from services.gateway.openai_map import BaseModel
from tests.conftest import wait_for, wait_nodes
from tests.harness.hang_dump import bounded
from tests.qa import QA_PAIRS


@pytest.fixture
async def gateway(stack, nc, tiny_model):
    models = {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu", served_by="llamacpp", save_steps=2)}
    await nc.jetstream().purge_stream(nats_subjects.kv(names.GATEWAY_JOBS_KV).stream)  # no job records of other tests
    gw = Gateway(nc, models, port=0)
    await gw.start()
    yield gw
    await bounded(gw.close(), 60, "the gateway's close")


async def client_for(nc, gateway: Gateway, tenant: str) -> openai.AsyncOpenAI:
    key, record = new_key(tenant)
    await (await KeyStore.open(nc.jetstream())).put(record)
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=key, max_retries=0)


def chat_rows(pairs) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
            ]
        }
        for q, a in pairs
    ]


def chat_file(path, rows=None) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows or chat_rows(QA_PAIRS)))
    return str(path)


async def check_results_file(client: openai.AsyncOpenAI, done, last_step: int) -> None:
    """A succeeded job's results file: OpenAI's CSV of step metrics, its valid_loss where it was evaluated (every
    checkpoint and the end), its trained tokens the job's."""
    assert done.trained_tokens and done.trained_tokens > 0 and len(done.result_files) == 1
    results = await client.files.retrieve(done.result_files[0])
    assert results.purpose == "fine-tune-results" and results.filename == "step_metrics.csv"
    text = (await client.files.content(results.id)).text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0]) == ["step", "train_loss", "valid_loss", "full_valid_loss", "learning_rate", "trained_tokens"]
    assert [int(r["step"]) for r in rows] == list(range(1, last_step + 1)) and results.bytes == len(text.encode())
    assert int(rows[-1]["trained_tokens"]) == done.trained_tokens and all(float(r["train_loss"]) > 0 for r in rows)
    evaluated = [int(r["step"]) for r in rows if r["valid_loss"]]
    assert evaluated == [s for s in range(2, last_step + 1, 2)] + ([last_step] if last_step % 2 else []), evaluated


async def finished(client: openai.AsyncOpenAI, job: str, timeout: float = 240.0):
    async def done():
        j = await client.fine_tuning.jobs.retrieve(job)
        return j if j.status in ("succeeded", "failed", "cancelled") else None

    return await wait_for(done, timeout, interval=0.5, what=f"job {job} to finish")


async def test_a_file_trains_through_the_openai_client_and_its_events_and_checkpoints_list(
    nc, gateway, agents, tmp_path
):
    agents.start("cpu-node", gpus=None, offer_cpu=True, trainer=None, interval=0.5)
    await wait_nodes(nc, 1)
    client = await client_for(nc, gateway, "acme")
    with open(chat_file(tmp_path / "capitals.jsonl"), "rb") as f:
        file = await client.files.create(file=f, purpose="fine-tune")
    assert file.bytes > 0 and file.filename == "capitals.jsonl" and file.purpose == "fine-tune"
    assert [x.id for x in (await client.files.list()).data] == [file.id]
    with open(chat_file(tmp_path / "heldout.jsonl", chat_rows(QA_PAIRS[:4])), "rb") as f:
        heldout = await client.files.create(file=f, purpose="fine-tune")

    job = await client.fine_tuning.jobs.create(
        model="tiny",
        training_file=file.id,
        validation_file=heldout.id,
        suffix="capitals",
        seed=7,
        metadata={"team": "geo"},
        method={
            "type": "supervised",
            "supervised": {"hyperparameters": {"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 25}},
        },
    )
    assert job.status in ("queued", "running") and job.training_file == file.id and job.seed == 7
    assert job.hyperparameters.n_epochs == 3 and job.metadata == {"team": "geo"}
    done = await finished(client, job.id)
    assert done.status == "succeeded", (done.error, agents.log("cpu-node")[-2000:])
    assert done.fine_tuned_model and "capitals" in done.fine_tuned_model and done.finished_at

    events = [e async for e in client.fine_tuning.jobs.list_events(job.id, limit=5)]  # pages of 5, newest first
    metrics = [e for e in events if e.type == "metrics"]
    steps = [e.data["step"] for e in metrics]
    assert steps == sorted(steps, reverse=True) and steps[-1] == 1, steps
    assert metrics[0].data["train_loss"] < metrics[-1].data["train_loss"]  # it learnt
    assert events[0].message.startswith("succeeded") and [e.id for e in events] == sorted(
        {e.id for e in events}, key=lambda i: -int(i.split("-")[1])
    )

    checkpoints = [c async for c in client.fine_tuning.jobs.checkpoints.list(job.id)]
    assert checkpoints and all(c.fine_tuning_job_id == job.id and c.step_number % 2 == 0 for c in checkpoints)
    assert checkpoints[0].metrics.train_loss is not None and checkpoints[0].metrics.step == checkpoints[0].step_number
    # evaluated at each checkpoint, as the job has a validation_file
    assert all(
        c.metrics.valid_loss is not None and c.metrics.full_valid_loss == c.metrics.valid_loss for c in checkpoints
    )
    await check_results_file(client, done, steps[0])
    globex = await client_for(nc, gateway, "globex")
    for ask in (globex.files.retrieve(done.result_files[0]), globex.files.content(done.result_files[0])):
        with pytest.raises(openai.NotFoundError):  # another tenant's job's results are not there
            await ask

    # the fine-tuned model is the registry's adapter, promoted for the fleet's engines to serve
    async def registered():
        reply = await bus.request(
            nc, names.ADAPTERS.show, AdapterQuery(name=done.fine_tuned_model), AdapterReply | Error
        )
        return reply if isinstance(reply, AdapterReply) and reply.alias.current == 1 else None

    shown = await wait_for(registered, 30, what="the adapter registered and promoted")
    assert shown.alias.tenant == "acme"
    assert [j.id for j in (await client.fine_tuning.jobs.list()).data] == [job.id]
    with pytest.raises(openai.BadRequestError, match="Not allowed to download"):
        await client.files.content(file.id)


async def test_pause_resume_and_cancel_through_the_openai_client(nc, gateway, agents, tmp_path):
    agents.start("n1", gpus=None, offer_cpu=True, hold_s=30)  # 10 steps of 3 s
    await wait_nodes(nc, 1)
    client = await client_for(nc, gateway, "acme")
    with open(chat_file(tmp_path / "d.jsonl"), "rb") as f:
        file = await client.files.create(file=f, purpose="fine-tune")
    job = await client.fine_tuning.jobs.create(model="tiny", training_file=file.id)

    seen = []

    async def status(wanted):
        j = await client.fine_tuning.jobs.retrieve(job.id)
        seen[:] = [j.status]
        return j.status == wanted

    async def becomes(wanted):
        try:
            await wait_for(lambda: status(wanted), 60, interval=0.2, what=wanted)
        except AssertionError:
            events = [
                (e.created_at, e.message)
                async for e in client.fine_tuning.jobs.list_events(job.id, limit=100)
                if e.type == "message"
            ]
            raise AssertionError(
                f"not {wanted}: {seen}; events {events[::-1]}; agent: {agents.log('n1')[-3000:]}"
            ) from None

    async def stepped():  # the trainer runs (and takes signals) once it reports a step
        return any([e async for e in client.fine_tuning.jobs.list_events(job.id) if e.type == "metrics"])

    await wait_for(stepped, 60, interval=0.3, what="a first step")
    assert (await client.fine_tuning.jobs.pause(job.id)).status in ("running", "paused")
    await becomes("paused")
    await client.fine_tuning.jobs.resume(job.id)
    await becomes("running")
    await client.fine_tuning.jobs.cancel(job.id)
    await becomes("cancelled")
    with pytest.raises(openai.BadRequestError) as e:  # over: nothing left to cancel
        await client.fine_tuning.jobs.cancel(job.id)
    assert e.value.code == "invalid_job_state"


async def test_bad_input_is_refused_naming_the_field_and_tenants_see_only_their_own(nc, gateway, tmp_path):
    acme, globex = await client_for(nc, gateway, "acme"), await client_for(nc, gateway, "globex")
    bad = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}] * 3
    bad.append({"messages": [{"role": "user", "content": "Hi"}, {"role": "asistant", "content": "Hello"}]})
    with open(chat_file(tmp_path / "bad.jsonl", bad), "rb") as f, pytest.raises(openai.BadRequestError) as e:
        await acme.files.create(file=f, purpose="fine-tune")
    assert e.value.param == "file" and "line 4" in e.value.message, e.value.message
    assert (await acme.files.list()).data == []  # nothing of it was stored

    with open(chat_file(tmp_path / "good.jsonl"), "rb") as f:
        file = await acme.files.create(file=f, purpose="fine-tune")
    for kwargs, param in (
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
        ({"model": "gpt-4o"}, "model"),
        ({"training_file": "file-nope"}, "training_file"),
        ({"hyperparameters": {"batch_size": "many"}}, "hyperparameters.batch_size"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await acme.fine_tuning.jobs.create(**{"model": "tiny", "training_file": file.id, **kwargs})
        assert e.value.param == param, (kwargs, e.value.message)
    assert (await acme.fine_tuning.jobs.list()).data == []  # none of them was queued

    wrong = openai.AsyncOpenAI(base_url=acme.base_url, api_key="jl-0123456789abcdef-guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.files.list()
    job = await acme.fine_tuning.jobs.create(model="tiny", training_file=file.id)
    assert (await globex.files.list()).data == [] and (await globex.fine_tuning.jobs.list()).data == []
    for ask in (
        globex.files.retrieve(file.id),
        globex.fine_tuning.jobs.retrieve(job.id),
        globex.fine_tuning.jobs.cancel(job.id),
        globex.fine_tuning.jobs.create(model="tiny", training_file=file.id),
    ):
        with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
            await ask


async def test_a_dpo_job_through_the_openai_client_reports_its_rewards(nc, gateway, agents, tmp_path):
    from tests.test_dpo import preference_rows

    agents.start("cpu-node", gpus=None, offer_cpu=True, trainer=None, interval=0.5)
    await wait_nodes(nc, 1)
    client = await client_for(nc, gateway, "acme")
    with open(chat_file(tmp_path / "prefs.jsonl", preference_rows()), "rb") as f:
        prefs = await client.files.create(file=f, purpose="fine-tune")
    with open(chat_file(tmp_path / "chat.jsonl"), "rb") as f:
        chat = await client.files.create(file=f, purpose="fine-tune")
    dpo = {
        "type": "dpo",
        "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 2, "batch_size": 8, "learning_rate_multiplier": 50}},
    }
    for file, method, param in (
        (chat.id, dpo, "training_file"),
        (prefs.id, {"type": "supervised"}, "training_file"),
        (prefs.id, {"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}, "hyperparameters.beta"),
    ):
        with pytest.raises(openai.BadRequestError) as e:  # the method and the file's rows must go together
            await client.fine_tuning.jobs.create(model="tiny", training_file=file, method=method)
        assert e.value.param == param, e.value.message

    sft = await finished(client, (await client.fine_tuning.jobs.create(model="tiny", training_file=chat.id)).id)
    assert sft.status == "succeeded", sft.error
    other = await client_for(nc, gateway, "globex")
    with open(tmp_path / "prefs.jsonl", "rb") as f:
        their_prefs = await other.files.create(file=f, purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as e:  # another tenant's fine-tuned model is not one to go on from
        await other.fine_tuning.jobs.create(model=sft.fine_tuned_model, training_file=their_prefs.id, method=dpo)
    assert e.value.param == "model" and "fine-tuned model of yours" in e.value.message, e.value.message
    # dpo after sft, as OpenAI's API does it: the fine-tuned model as `model`
    job = await client.fine_tuning.jobs.create(model=sft.fine_tuned_model, training_file=prefs.id, method=dpo)
    assert job.method.type == "dpo" and job.hyperparameters.beta == 0.2 and job.model == sft.fine_tuned_model
    done = await finished(client, job.id)
    assert done.status == "succeeded", (done.error, agents.log("cpu-node")[-2000:])
    metrics = [
        e.data for e in [e async for e in client.fine_tuning.jobs.list_events(job.id, limit=100)] if e.type == "metrics"
    ]
    assert len(metrics) == 4 and all("reward_margin" in m and "reward_accuracy" in m for m in metrics)
    assert metrics[0]["reward_margin"] > metrics[-1]["reward_margin"]  # newest first: the margin grew
