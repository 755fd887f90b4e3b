"""Reinforcement fine-tuning through the gateway with OpenAI's own client, against the real stack: an SFT job, then
a reinforcement job from its fine-tuned model graded by a string_check grader; its events carry the rewards as
OpenAI's RFT metrics events do, its checkpoints the eval reward, its model is listed. Bad reinforcement requests
are refused naming the field. And a node's --python-graders reaches its trainers."""

from __future__ import annotations

import csv
import io
import json
import time

import openai
import pytest

from schemas import names, nats_subjects
from schemas.jobs import Accepted
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.reinforcement import group_size
from tests.conftest import submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs
from tests.test_gateway import client_for, finished
from tests.test_grpo import SAYS_PARIS, grpo_train, rft_rows

REINFORCEMENT = {  # tests/test_grpo.py's grpo_train() in OpenAI's terms: steps of 4 prompts, 8 samples each, at
    # lr 0.002 (0.005 undoes this sft's answers at the first step that learns: Adam's first step moves every weight
    # by about lr), so 60 steps
    "n_epochs": 30,
    "batch_size": 4,
    "learning_rate_multiplier": 10,
    "compute_multiplier": 2,
    "eval_interval": 10,
    "eval_samples": 8,
}
OPERATORS = ("max_completion_tokens", "temperature", "grpo_beta", "lr_scheduler", "warmup_steps", "max_seq_length")
RFT_TRAIN = {k: grpo_train()[k] for k in OPERATORS}  # the rest, OpenAI has no place for: the gateway's operator's


@pytest.fixture
async def gateway(stack, nc, tiny_model):
    models = {
        "tiny": BaseModel(
            "tiny", str(tiny_model), accelerator="cpu", served_by="llamacpp", save_steps=20, reinforcement=RFT_TRAIN
        )
    }
    await nc.jetstream().purge_stream(nats_subjects.kv(names.GATEWAY_JOBS_KV).stream)
    gw = Gateway(nc, models, port=0)
    await gw.start()
    yield gw
    await gw.close()


async def upload(client: openai.AsyncOpenAI, path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(path, "rb") as f:
        return (await client.files.create(file=f, purpose="fine-tune")).id


def reinforcement(grader=SAYS_PARIS, **hyperparameters) -> dict:
    return {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hyperparameters}}


async def test_sft_then_reinforcement_through_the_openai_client(nc, gateway, agents, tmp_path):
    started = time.monotonic()
    agents.start("cpu-node", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    client = await client_for(nc, gateway, "acme")
    sft_file = await upload(client, tmp_path / "qa.jsonl", pairs())  # tests/test_grpo.py's, as the fleet takes it
    rft_file = await upload(client, tmp_path / "capitals.jsonl", rft_rows())
    sft = await client.fine_tuning.jobs.create(  # tests/test_grpo.py's sft, one packed row of all 16 pairs a step
        model="tiny",
        training_file=sft_file,
        suffix="capitals",
        seed=42,
        method={"type": "supervised", "supervised": {"hyperparameters": sft_hyperparameters()}},
    )
    await refused(client, sft_file, rft_file)
    sft = await finished(client, sft.id, 180)
    assert sft.status == "succeeded", (sft.error, agents.log("cpu-node")[-3000:])

    job = await client.fine_tuning.jobs.create(
        model=sft.fine_tuned_model,
        training_file=rft_file,
        validation_file=rft_file,
        seed=42,
        method=reinforcement(**REINFORCEMENT, reasoning_effort="default"),
    )
    assert job.method.type == "reinforcement" and job.model == sft.fine_tuned_model
    shown = job.method.reinforcement
    assert shown.grader.type == "string_check" and shown.grader.reference == "Paris"
    assert shown.hyperparameters.compute_multiplier == 2 and shown.hyperparameters.eval_interval == 10
    done = await finished(client, job.id, 300)
    assert done.status == "succeeded", (done.error, agents.log("cpu-node")[-3000:])

    events = [e async for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
    metrics = [e.data for e in reversed(events) if e.type == "metrics"]
    rewards = [m["train_mean_reward"] for m in metrics]
    print(f"rft through the gateway: rewards {[round(r, 2) for r in rewards]}; {time.monotonic() - started:.0f} s")
    assert [m["step"] for m in metrics] == list(range(1, 61)), [m["step"] for m in metrics]
    assert sum(rewards[:3]) / 3 <= 0.3, rewards
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
    last = metrics[-1]
    assert last["scores"]["graders"][0]["name"] == "says_paris" and last["scores"]["train_reward_mean"] == rewards[-1]
    assert last["full_valid_mean_reward"] >= 0.8 and last["errors"]["train_other_error_count"] == 0
    assert 0 <= last["train_pass_rate"] <= 1 and last["completion_tokens_mean"] > 0
    assert any("train mean reward=" in e.message and "full validation mean reward=" in e.message for e in events)

    checkpoints = (await client.fine_tuning.jobs.checkpoints.list(job.id)).data
    assert [c.step_number for c in checkpoints] == [40, 20], checkpoints
    assert all(c.metrics.full_valid_mean_reward is not None for c in checkpoints) and checkpoints[0].metrics.step == 40
    assert done.fine_tuned_model and done.fine_tuned_model != sft.fine_tuned_model
    rows = list(csv.DictReader(io.StringIO((await client.files.content(done.result_files[0])).text)))
    assert list(rows[0])[-4:] == ["train_mean_reward", "train_reward_std", "train_pass_rate", "full_valid_mean_reward"]
    assert float(rows[-1]["train_mean_reward"]) == rewards[-1] and float(rows[-1]["full_valid_mean_reward"]) >= 0.8

    async def listed() -> bool:
        return done.fine_tuned_model in [m.id for m in (await client.models.list()).data]

    await wait_for(listed, 30, what="the reinforcement job's fine-tuned model listed")


def sft_hyperparameters() -> dict:
    return {"n_epochs": 50, "batch_size": 1, "learning_rate_multiplier": 50}


async def refused(client: openai.AsyncOpenAI, sft_file: str, rft_file: str) -> None:
    """Each bad reinforcement request is a 400 naming the field as the client sent it; nothing is queued."""
    before = len((await client.fine_tuning.jobs.list()).data)
    for file, method, param, said in (
        (rft_file, reinforcement({**SAYS_PARIS, "operation": "contains"}), "method.reinforcement.grader.operation", ""),
        (
            rft_file,
            reinforcement({**SAYS_PARIS, "input": "{{sample.output_txt}}"}),
            "method.reinforcement.grader.input",
            "output_txt",
        ),
        (
            rft_file,
            reinforcement(reasoning_effort="high"),
            "method.reinforcement.hyperparameters.reasoning_effort",
            "do not reason",
        ),
        (rft_file, reinforcement(eval_interval=5), "method.reinforcement.hyperparameters.eval_interval", "validation"),
        (rft_file, {"type": "reinforcement"}, "method.reinforcement", "grader"),
        (sft_file, reinforcement(), "training_file", "name an rft file"),
        (rft_file, {"type": "supervised"}, "training_file", "set method.type to reinforcement"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await client.fine_tuning.jobs.create(model="tiny", training_file=file, method=method)
        assert e.value.param == param and said in e.value.message, (param, e.value.param, e.value.message)
    assert len((await client.fine_tuning.jobs.list()).data) == before


def test_compute_multiplier_sets_the_group():
    assert [group_size(m) for m in ("auto", 0.1, 1, 1.4, 2, 64)] == [4, 2, 4, 6, 8, 256]


async def test_a_node_that_turns_python_graders_off_fails_their_jobs_naming_the_flag(
    stack, nc, agents, tiny_model, tmp_path
):
    from services.transfer.sender import upload_dataset
    from tests.test_dataset_formats import data_file

    agents.start("strict", gpus=None, offer_cpu=True, trainer=None, extra=("--python-graders", "off"))
    await wait_nodes(nc, 1)
    await upload_dataset(nc, "capitals-rft", data_file(tmp_path / "rft.jsonl", "rft", rft_rows()).path)
    grader = {"type": "python", "name": "short", "source": "def grade(sample, item):\n    return 1.0\n"}
    train = {"method": "grpo", "grader": grader, "max_steps": 1, "max_seq_length": 128}
    job = {"model": "tiny", "base_dir": str(tiny_model), "accelerator": "cpu", "dataset": {"name": "capitals-rft"}}
    reply = await submit(nc, {**job, "train": train})  # the scheduler has no say in where graders run: taken
    assert isinstance(reply, Accepted), reply
    done = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=60)
    assert done.state == "failed" and "jetlora agent --python-graders off" in done.message, done.message
