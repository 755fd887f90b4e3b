"""The routes Tinker users reach for next, through the official client's RestClient: a tenant's training runs and
sessions, a run's checkpoints (training states and sampler weights) listed, given a TTL and deleted; LoraConfig's
train_attn / train_mlp / train_unembed / seed shape the adapter the session trains (every loss against its formula:
tests/test_tinker_losses.py)."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
import torch

from schemas.events import TrainerSpec
from schemas.jobs import JobRequest
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.outcomes import STEP_METRIC
from tests.conftest import wait_nodes
from tests.test_tinker_api import datums, key_for

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")


def runs_and_checkpoints(port: int, key: str, other: str) -> dict:
    import tinker
    from tinker import types

    url = f"http://127.0.0.1:{port}"
    with tinker.ServiceClient(base_url=url, api_key=key) as sc:
        tc = sc.create_lora_training_client(
            base_model="tiny", rank=4, seed=3, train_unembed=False, user_metadata={"renderer_name": "role_colon"}
        ).result()
        batch, _ = datums(tc.get_tokenizer(), types)
        rl = [types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "logprobs": [-1.0] * d.model_input.length, "advantages": [0.5] * d.model_input.length}) for d in batch]  # fmt: skip
        losses = {name: tc.forward_backward(rl, name, {"beta": 0.1} if name == "dro" else None).result()
                  for name in ("cispo", "dro")}  # fmt: skip
        stepped = tc.optim_step(types.AdamParams(learning_rate=1e-4)).result().metrics  # beside a loop's own columns
        state = tc.save_state("kept").result().path
        sampler = tc.save_weights_for_sampler("shown", ttl_seconds=7200).result().path
        sc.create_sampling_client(model_path=sampler).result()
        rest = tinker.RestClient(base_url=url, api_key=key)
        out = {
            "model_id": tc.model_id,
            "losses": {name: r.metrics["loss:sum"] for name, r in losses.items()},
            "runs": rest.list_training_runs().result(),
            "run": rest.get_training_run(tc.model_id).result(),
            "sessions": rest.list_sessions().result().sessions,
            "session": rest.get_session(tc.model_id.split(":")[0]).result(),
            "state": state,
            "sampler": sampler,
            "optim metrics": stepped,
        }
        rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
        out["with_ttl"] = rest.list_checkpoints(tc.model_id).result().checkpoints
        rest.delete_checkpoint_from_tinker_path(sampler).result()
        out["after_delete"] = rest.list_checkpoints(tc.model_id).result().checkpoints
        with pytest.raises(tinker.NotFoundError):
            sc.create_sampling_client(model_path=sampler).result()
        stranger = tinker.RestClient(base_url=url, api_key=other)
        with pytest.raises(tinker.NotFoundError):
            stranger.get_training_run(tc.model_id).result()
        out["strangers_runs"] = stranger.list_training_runs().result().training_runs
        return out


async def test_runs_sessions_and_checkpoints_through_the_rest_client(nc, stack, tiny_model, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0)
    await gw.start()
    try:
        key, other = await key_for(nc, "acme"), await key_for(nc, "globex")
        out = await asyncio.wait_for(asyncio.to_thread(runs_and_checkpoints, gw.port, key, other), 240)
    finally:
        await gw.close()
    model_id, run = out["model_id"], out["run"]
    assert all(loss == loss and loss != 0 for loss in out["losses"].values()), out["losses"]  # served, finite
    assert [r.training_run_id for r in out["runs"].training_runs] == [model_id] and out["runs"].cursor.total_count == 1
    assert (run.base_model, run.model_owner, run.lora_rank) == ("tiny", "acme", 4)
    assert run.user_metadata == {"renderer_name": "role_colon"}  # given at create: the cookbook reads its renderer
    assert "step" not in out["optim metrics"] and out["optim metrics"][STEP_METRIC] == 1.0, out["optim metrics"]
    assert run.last_checkpoint.tinker_path == out["state"]
    assert run.last_sampler_checkpoint.tinker_path == out["sampler"]
    assert run.last_sampler_checkpoint.expires_at is not None  # the TTL the save was given
    session = model_id.split(":")[0]
    assert session in out["sessions"]
    assert out["session"].training_run_ids == [model_id] and out["session"].sampler_ids == [f"{model_id}:sample:shown"]
    expiring = {c.tinker_path: c.expires_at for c in out["with_ttl"]}
    assert expiring[out["state"]] is not None
    assert [c.tinker_path for c in out["after_delete"]] == [out["state"]]
    assert out["strangers_runs"] == []


def session_of(tiny_model, tmp_path, **spec):
    from trainer import events
    from trainer.session.serve import Session

    request = msgspec.convert({"model": "tiny", "base_dir": str(tiny_model), "train": {"method": "session"},
                               "session": {"rank": 4, **spec}, "accelerator": "cpu"}, JobRequest)  # fmt: skip
    with events.muted():  # not for the rest of the tests' process: others read the trainer's events from stdout
        return Session(TrainerSpec(job="t", attempt=1, request=request, out_dir=str(tmp_path)))


def adapted(session) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in session.model.named_parameters() if "lora_A" in n}


def test_lora_config_chooses_the_adapters_layers_and_its_seed_its_first_weights(tiny_model, tmp_path):
    mlp_head = session_of(tiny_model, tmp_path / "a", train_attn=False, train_mlp=True, train_unembed=True, seed=7)
    layers = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name in adapted(mlp_head)}
    assert layers == {"gate_proj", "up_proj", "down_proj", "lm_head"}, layers
    again = session_of(tiny_model, tmp_path / "b", train_attn=False, train_mlp=True, train_unembed=True, seed=7)
    other = session_of(tiny_model, tmp_path / "c", train_attn=False, train_mlp=True, train_unembed=True, seed=8)
    first, same, different = adapted(mlp_head), adapted(again), adapted(other)
    assert all(torch.equal(first[n], same[n]) for n in first)
    assert not any(torch.equal(first[n], different[n]) for n in first)
    attention = session_of(tiny_model, tmp_path / "d", train_attn=True, train_mlp=False, train_unembed=False)
    assert {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in adapted(attention)} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }
