"""The demo's job, trained for real on the demo's small model: its held-out paraphrases measure what it teaches
(the eval loss ends below where it started) and the adapter it keeps answers the trained questions."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from schemas import names
from schemas.events import Progress
from schemas.jobs import Accepted
from services import bus
from services.transfer.sender import upload_dataset
from services.cli.demo import HELD_OUT, HELD_OUT_FILE, QA_FILE, TRAINED, before_and_after, build_model, demo_request
from tests.conftest import stream_events, wait_nodes, wait_state


# pytest-timeout is the guard against a hang only: the wait below follows the job's steps, and 400 steps on a CPU
# another process keeps busy take several times the quiet machine's 30 s
@pytest.mark.timeout(1200)
async def test_the_demo_job_learns_what_it_is_evaluated_on_and_answers_its_questions(nc, stack, agents, tmp_path):
    model = await asyncio.to_thread(build_model, tmp_path / "base-model")  # off the loop the services run on
    data = [json.loads(line) for line in QA_FILE.read_text().splitlines() if line.strip()]
    agents.start("demo-node", gpus=None, offer_cpu=True, trainer=None)
    await wait_nodes(nc, 1)
    await upload_dataset(nc, HELD_OUT, HELD_OUT_FILE)
    reply = await bus.request(nc, names.SUBMIT, demo_request(model, data, steps=400), Accepted, timeout=30)
    job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=120)  # 120 s without a step
    assert job.state == "succeeded", (job.message, agents.log("demo-node")[-3000:])

    progress = await stream_events(nc, names.job(reply.job).progress, msgspec.json.Decoder(Progress))
    evals = [p.eval_loss for p in progress if p.eval_loss is not None]
    print(f"eval loss on the held-out paraphrases: first {evals[0]:.3f}, lowest {min(evals):.3f}, last {evals[-1]:.3f}")
    assert evals[-1] < evals[0], evals

    answers = {row["q"]: row["a"] for row in data}
    rows = await before_and_after(nc, reply.job)
    trained = rows[:TRAINED]
    exact = [prompt for prompt, _, adapter in trained if adapter.strip() == answers[prompt]]
    print("before and after:", *rows, sep="\n  ")
    assert len(exact) * 2 >= len(trained), trained
