"""Engine rollouts, the parts that need no engine (tests/test_rl_vllm.py runs them against a real vLLM):
train.rollouts checked at submit naming the field; which engine an agent offers a grpo job, and why none; a job
that asks for engine rollouts on a node without a vLLM fails saying so; a batch built from an engine's tokens is
laid out exactly as the trainer's own generate lays it out; the probe comparison tells the version the engine
serves from the one before it."""

from __future__ import annotations

import msgspec
import pytest
import torch

from schemas.jobs import Accepted, JobRequest, Rejected
from schemas.training import LoraConfig
from services.agent.engines import Engine, rollout_engine
from services.transfer.sender import upload_dataset
from tests.conftest import submit, wait_nodes, wait_state
from tests.test_dataset_formats import data_file
from tests.test_grpo import SAYS_PARIS, grpo_train, rft_rows
from trainer.objectives.engine_rollouts import Fingerprint, layout, serves
from trainer.objectives.rollouts import complete, eos_ids, pad_id


def request(**train) -> JobRequest:
    body = {"model": "tiny", "base_dir": "/models/tiny", "train": {"method": "grpo", "grader": SAYS_PARIS, **train}}
    return msgspec.convert(body, JobRequest)


def test_the_agent_offers_its_vllm_of_the_jobs_model_or_says_why_not():
    vllm = Engine.parse("vllm=http://127.0.0.1:8000/", "tiny", max_rank=16)
    other_model = Engine.parse("vllm=http://127.0.0.1:8001", "big")
    llama = Engine.parse("llamacpp=/srv/gguf,http://127.0.0.1:8080", "tiny")
    engine, why = rollout_engine([other_model, llama, vllm], request(rollouts="engine"), priority=10)
    assert engine is not None and engine.url == "http://127.0.0.1:8000" and engine.priority == 10 and why == ""
    assert rollout_engine([vllm], request(rollouts="trainer"), 10) == (None, "")
    for engines, req, said in (
        ([llama, other_model], request(rollouts="auto"), "no vLLM engine of tiny (an agent started with --engine"),
        ([vllm], msgspec.structs.replace(request(rollouts="engine"), lora=LoraConfig(r=32)), "up to 16"),
        ([vllm], msgspec.structs.replace(request(rollouts="engine"), lora=LoraConfig(r=8, init="pissa")), None),
    ):
        engine, why = rollout_engine(engines, req, 0)
        if said is None:  # pissa at r 8 is served at rank 16: fits
            assert engine is not None, why
        else:
            assert engine is None and said in why, why


@pytest.fixture(scope="module")
def policy(tiny_model):
    from peft import get_peft_model

    from trainer.adapter_init import lora_config
    from trainer.model import load

    tokenizer, model = load(str(tiny_model), "cpu", torch.float32)
    return tokenizer, get_peft_model(model, lora_config(LoraConfig(r=4), "cpu"))


def test_a_batch_of_engine_tokens_is_laid_out_as_the_trainers_own(policy):
    tokenizer, model = policy
    prompts = [tokenizer("What is the capital of France?")["input_ids"], tokenizer("Hi")["input_ids"]] * 3
    torch.manual_seed(0)
    ids, attention, completion_mask = complete(model, tokenizer, prompts, 12, 1.5, "cpu")
    eos, width = eos_ids(model, tokenizer), ids.shape[1] - completion_mask.shape[1]
    # what an engine sends back for each prompt: the completion's tokens through its end token, no padding
    completions = [row[width:][mask.bool()].tolist() for row, mask in zip(ids, completion_mask)]
    assert any(c[-1] in eos for c in completions) or all(len(c) == 12 for c in completions)
    built = layout(prompts, completions, eos, pad_id(tokenizer))
    for mine, theirs in zip((ids, attention, completion_mask), built):
        assert torch.equal(mine, theirs)


def test_the_probe_tells_the_version_served_from_the_one_before():
    now = Fingerprint((5, 6, 7, 8, 2), (-0.5, -0.4, -0.3, -0.2, -0.1))
    before = Fingerprint((5, 6, 7, 8, 2), (-0.6, -0.45, -0.3, -0.2, -0.1))
    assert serves(now, now, before) and serves(now, now, None)
    assert not serves(before, now, before)
    precise = Fingerprint(now.tokens, tuple(x + 1e-3 for x in now.logps))  # another precision's answer
    assert serves(precise, now, before)
    assert not serves(Fingerprint((5, 6, 9, 9, 2), now.logps), now, None)  # its first tokens differ
    assert serves(Fingerprint((5, 6, 7, 8, 9), now.logps), now, None)  # the head agrees, the tail drifted
    diverged = Fingerprint((5, 6, 7, 8, 3), before.logps)  # the previous version's tail, but nearer now's tokens
    assert serves(diverged, now, Fingerprint((5, 6, 7, 1, 1), before.logps))


async def test_engine_rollouts_are_refused_or_failed_naming_the_field(stack, nc, agents, tiny_model, tmp_path):
    """At submit: train.rollouts is grpo's, and one of three; on a node without a vLLM: the job fails saying so."""
    agents.start("plain", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    base = {"model": "tiny", "base_dir": str(tiny_model), "accelerator": "cpu"}
    for train, said in (
        ({"rollouts": "engine", "max_steps": 1}, "train.rollouts is grpo's"),
        (grpo_train(rollouts="vllm"), "Invalid enum value 'vllm'"),
    ):
        reply = await submit(nc, {**base, "data": [{"q": "a", "a": "b"}], "train": train})
        assert isinstance(reply, Rejected) and reply.errors[0].field == "train.rollouts", reply
        assert said in reply.errors[0].reason, reply.errors[0].reason
    await upload_dataset(nc, "rft-plain", data_file(tmp_path / "rft.jsonl", "rft", rft_rows()).path)
    reply = await submit(
        nc, {**base, "dataset": {"name": "rft-plain"}, "train": grpo_train(rollouts="engine", eval_steps=0)}
    )
    assert isinstance(reply, Accepted), reply
    job = await wait_state(nc, reply.job, ("failed", "succeeded"), timeout=120)
    assert job.state == "failed" and "train.rollouts is engine, but this node has no vLLM engine of tiny" in job.message
    assert "set train.rollouts to auto or trainer" in job.message, job.message
