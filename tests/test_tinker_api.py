"""The official `tinker` client (0.38.0) drives jetlora through the gateway, on the real stack (nats-server,
scheduler, artifact service, registry, an agent as a process with the real trainer, the tiny local model): a
supervised loop whose loss falls and whose final adapter, stored when the session ends, loads in PEFT with the
log-probs the API's forward gave; an RL loop (samples, rewards computed here, importance_sampling) whose reward rises;
save_state / load_state; and one tenant's key never sees or drives another's session."""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
import pytest
import torch

from schemas import names
from schemas.job_status import JobList, JobListQuery
from schemas.registry import AdapterQuery, AdapterReply
from services import bus
from services.gateway.app import Gateway
from services.gateway.keys import KeyStore, new_key
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from services.transfer.download import download, safe_extract
from tests.conftest import ROOT, wait_nodes, wait_state
from tests.qa import QA_PAIRS

pytestmark = pytest.mark.timeout(600)
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture
async def gateway(stack, nc, tiny_model, agents):
    # a pause for a silent client is test_tinker_silence's: on a busy machine the client's heartbeats, answered by
    # this process's loop, can lapse for 30 s, and a pause then ends a closed session cancelled, not stopped, and
    # takes an explicit pause's place (test_review_tinker_between_calls)
    settings = TinkerSettings(silence_s=600)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0, tinker_settings=settings)
    await gw.start()
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    yield gw
    await gw.close()


async def key_for(nc, tenant: str) -> str:
    key, record = new_key(tenant)
    await (await KeyStore.open(nc.jetstream())).put(record)
    return "tml-" + key


def client(gw: Gateway, key: str):
    import tinker

    return tinker.ServiceClient(base_url=f"http://127.0.0.1:{gw.port}", api_key=key)


def datums(tokenizer, types) -> tuple[list, int]:
    """Each QA pair as a datum: the answer's tokens weighed, the question's not (as the cookbook builds them)."""
    out, weighed = [], 0
    for q, a in QA_PAIRS[:8]:
        prompt, answer = tokenizer.encode(q + " "), tokenizer.encode(a, add_special_tokens=False)
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        weighed += len(answer)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return out, weighed


def supervised(gw: Gateway, key: str) -> dict:

    with client(gw, key) as sc:  # its end finishes the session: the adapter is stored as the job's artifact
        return supervised_loop(gw, key, sc)


def supervised_loop(gw: Gateway, key: str, sc) -> dict:
    import tinker
    from tinker import types

    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0, train_unembed=False).result()
    tokenizer = tc.get_tokenizer()
    batch, weighed = datums(tokenizer, types)
    losses = []
    for _ in range(25):
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"] / weighed)
        opt.result()
    saved = tc.save_state("after-25").result().path
    before = tc.forward(batch, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # nothing accumulated: the weights stay
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()  # moves them
    tc.load_state(saved).result()  # back to step 25's adapter
    after = tc.forward(batch, "cross_entropy").result()
    sampler = tc.save_weights_for_sampler("final").result().path
    prompt = types.ModelInput.from_ints(tokenizer.encode(QA_PAIRS[0][0] + " "))
    sampling = sc.create_sampling_client(model_path=sampler).result()
    sample = sampling.sample(prompt, 2, types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
    rest = tinker.RestClient(base_url=f"http://127.0.0.1:{gw.port}", api_key=key)
    runs = rest.list_checkpoints(tc.model_id).result()
    return {
        "losses": losses,
        "model_id": tc.model_id,
        "state": saved,
        "before": [o["logprobs"].tolist() for o in before.loss_fn_outputs],
        "after": [o["logprobs"].tolist() for o in after.loss_fn_outputs],
        "batch": [(d.model_input.to_ints(), list(d.loss_fn_inputs["target_tokens"].tolist())) for d in batch],
        "sample": [(s.tokens, s.logprobs) for s in sample.sequences],
        "prompt": prompt.to_ints(),
        "checkpoints": [c.tinker_path for c in runs.checkpoints],
    }


async def test_a_supervised_loop_trains_saves_loads_and_its_adapter_loads_in_peft(
    nc, gateway, tiny_model, tmp_path, nats_server
):
    key = await key_for(nc, "acme")
    out = await asyncio.to_thread(supervised, gateway, key)
    losses = out["losses"]
    print(f"loss per weighed token: step 1 {losses[0]:.3f}, step {len(losses)} {losses[-1]:.3f}")
    assert losses[-1] < 0.6 * losses[0], losses  # it learns the answers
    assert out["state"] == f"tinker://{out['model_id']}/weights/after-25"
    assert out["after"] == out["before"]  # load_state restored step 25's adapter exactly
    run = f"tinker://{out['model_id']}"  # its saves, oldest first: a state, then sampler weights
    assert out["checkpoints"] == [f"{run}/weights/after-25", f"{run}/sampler_weights/final"]
    for tokens, logprobs in out["sample"]:
        assert tokens and len(logprobs) == len(tokens) and all(lp <= 0 for lp in logprobs)

    jobs = await bus.request(nc, names.jobs_api("acme").jobs, JobListQuery(), JobList)
    job = next(j for j in jobs.jobs if j.label.endswith(out["model_id"]))
    done = await wait_state(nc, job.id, ("stopped", "succeeded", "failed"), timeout=60)
    assert done.state == "stopped" and [a.kind for a in done.artifacts][:1] == ["peft"], done.message
    await download(nc, job.id, "peft", tmp_path / "peft.tar")
    adapter = safe_extract(tmp_path / "peft.tar", tmp_path / "adapter")

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    worst = 0.0
    with torch.no_grad():
        for (tokens, targets), served in zip(out["batch"], out["after"]):
            logits = model(input_ids=torch.tensor([tokens])).logits.float()
            lp = torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(targets).long().unsqueeze(-1)).squeeze(-1)
            worst = max(worst, float((lp - torch.tensor(served)).abs().max()))
        for tokens, logprobs in out["sample"]:  # the sampler's log-probs are the trainer's (it samples itself)
            ids = torch.tensor([out["prompt"] + tokens[:-1]])
            lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, len(out["prompt"]) - 1 :]
            picked = lp.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
            worst = max(worst, float((picked - torch.tensor(logprobs)).abs().max()))
    assert worst < 1e-5, worst

    # what the loop trained becomes a registry version, as any job's adapter does
    registered = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "adapters", "register", "tinker-capitals", "--from-session",
        out["model_id"], "--nats", nats_server.url, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert await registered.wait() == 0
    reply = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name="tinker-capitals"), AdapterReply)
    version = reply.versions[0]
    assert (version.job, version.r, version.probe is not None) == (job.id, 8, True)
    assert version.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def reinforcement(gw: Gateway, key: str) -> list[float]:
    """The cookbook's rl_loop on one prompt: sample a group, reward the completions that start with a target token
    (one the adapter rarely starts with at first), advantages centred in the group, importance_sampling with the
    sampler's own log-probs."""

    with client(gw, key) as sc:
        return reinforcement_loop(sc)


def reinforcement_loop(sc) -> list[float]:
    from tinker import types

    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=1, train_unembed=False).result()
    prompt = tc.get_tokenizer().encode("What is the capital of France?")
    first = tc.save_weights_and_get_sampling_client().result()
    starts = [
        s.tokens[0]
        for s in first.sample(
            types.ModelInput.from_ints(prompt), 32, types.SamplingParams(max_tokens=1, temperature=1.0, seed=99)
        )
        .result()
        .sequences
    ]
    # a first token the adapter picks now and then (a few in 32), not its favourite
    target = min(set(starts), key=lambda t: (abs(starts.count(t) - 4), t))
    rewards = []
    for step in range(12):
        sampler = tc.save_weights_and_get_sampling_client().result()
        got = sampler.sample(
            types.ModelInput.from_ints(prompt), 8, types.SamplingParams(max_tokens=3, temperature=1.0, seed=step)
        ).result()
        scores = [1.0 if s.tokens[:1] == [target] else 0.0 for s in got.sequences]
        rewards.append(sum(scores) / len(scores))
        mean = rewards[-1]
        batch = []
        for s, r in zip(got.sequences, scores):
            ob = len(prompt) - 1
            batch.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(prompt + s.tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": [0] * ob + s.tokens,
                        "logprobs": [0.0] * ob + s.logprobs,
                        "advantages": [0.0] * ob + [r - mean] * len(s.tokens),
                    },
                )
            )
        if any(r != mean for r in scores):
            tc.forward_backward(batch, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return rewards


async def test_an_rl_loop_samples_groups_and_its_reward_rises(nc, gateway, tiny_model):
    rewards = await asyncio.to_thread(reinforcement, gateway, await key_for(nc, "acme"))
    print("rewards per step:", rewards)
    assert rewards[0] <= 0.5 and min(rewards[-3:]) >= rewards[0] + 0.5, rewards  # e.g. 0.125 -> 1.0


async def test_one_tenants_key_never_sees_or_drives_anothers_session(nc, gateway):
    import tinker

    mine, theirs = await key_for(nc, "acme"), await key_for(nc, "globex")

    sc = client(gateway, mine)  # open while the other tenant tries its session; closed at the end

    def start() -> str:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, train_unembed=False).result()
        tc.save_weights_for_sampler("s").result()
        return tc.model_id

    model_id = await asyncio.to_thread(start)
    url = f"http://127.0.0.1:{gateway.port}/api/v1"
    async with aiohttp.ClientSession(headers={"X-API-Key": theirs}) as http:
        for path, body in (
            ("get_info", {"model_id": model_id}),
            ("optim_step", {"model_id": model_id, "seq_id": 5, "adam_params": {}}),
            ("save_weights", {"model_id": model_id, "seq_id": 5, "path": "x"}),
            ("create_sampling_session", {"session_id": "x", "model_path": f"tinker://{model_id}/sampler_weights/s"}),
        ):
            async with http.post(f"{url}/{path}", json=body) as r:
                assert r.status == 404, (path, r.status, await r.text())
                assert "of yours" in (await r.json())["detail"]
        async with http.get(f"{url}/training_runs/{model_id}/checkpoints") as r:
            assert r.status == 404
    with pytest.raises(tinker.TinkerError, match="tml-"):  # the client's own check: a bare jetlora key
        await asyncio.to_thread(
            lambda: client(gateway, mine.removeprefix("tml-")).create_lora_training_client("tiny").result()
        )
    async with aiohttp.ClientSession(headers={"X-API-Key": "tml-jl-nope"}) as http:
        async with http.post(f"{url}/client/config", json={}) as r:
            assert r.status == 401 and "tml-<a jetlora key>" in (await r.json())["detail"]
    await asyncio.to_thread(lambda: sc.close("success"))  # its heartbeats stop with it


def base_logprobs(gw: Gateway, key: str, prompt: list[int]) -> list:
    from tinker import types

    with client(gw, key) as sc:
        sampler = sc.create_sampling_client(base_model="tiny").result()
        return sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()


async def test_a_base_models_sampler_gives_the_base_models_own_logprobs(nc, gateway, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_model).encode(QA_PAIRS[2][0] + " " + QA_PAIRS[2][1])
    served = await asyncio.to_thread(base_logprobs, gateway, await key_for(nc, "acme"), prompt)
    assert served[0] is None and len(served) == len(prompt)  # the first token has none
    base = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(base(input_ids=torch.tensor([prompt])).logits.float(), -1)[0, :-1]
    expected = lp.gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1)
    assert float((torch.tensor(served[1:]) - expected).abs().max()) < 1e-5


def refused_then_goes_on(gw: Gateway, key: str) -> tuple[str, int]:
    import tinker
    from tinker import types

    with client(gw, key) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, train_unembed=False).result()
        batch, _ = datums(tc.get_tokenizer(), types)
        try:
            tc.optim_step(types.AdamParams(learning_rate=0.0)).result()
            refusal = ""
        except tinker.BadRequestError as e:
            refusal = str(e)
        out = tc.forward(batch, "cross_entropy").result(timeout=120)  # the refused seq_id took its turn as nothing
        return refusal, len(out.loss_fn_outputs)


async def test_a_refused_call_names_its_field_and_the_calls_after_it_run(nc, gateway):
    refusal, answered = await asyncio.to_thread(refused_then_goes_on, gateway, await key_for(nc, "acme"))
    assert "adam_params" in refusal and "learning_rate" in refusal, refusal
    assert answered == 8
