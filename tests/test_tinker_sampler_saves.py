"""Named sampler saves live in the object store, not in a session: each is an artifact of its own (never in the
session's checkpoint, memory or record), read back when it is sampled (after a pause too), counted against the
tenant's max_sampler_saves (a 400 the client does not retry, naming the bound), and deleting one frees its place
and its object. With the official client, an agent and its trainer as processes."""

from __future__ import annotations

import asyncio
import os
import tarfile

import msgspec
import pytest

from schemas import names
from schemas.jobs import Error
from schemas.job_status import JobQuery, JobReply
from schemas.object_headers import info_from_object
from schemas.tinker_store import ModelRecord, model_key
from services import bus
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.settings import TinkerSettings
from services.transfer.download import download_named
from tests.conftest import get_job, wait_for, wait_nodes
from tests.test_tinker_api import client, datums, key_for
from tests.test_tinker_sessions import job_of

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture
async def gateway(stack, nc, tiny_model, agents):
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0,
                 tinker_settings=TinkerSettings(max_sampler_saves=2))  # fmt: skip
    await gw.start()
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    yield gw
    await gw.close()


class Saver:
    def __init__(self, gw: Gateway, key: str) -> None:
        import tinker
        from tinker import types

        self.tinker, self.types, self.gw, self.key = tinker, types, gw, key
        self.sc = client(gw, key)
        self.tc = self.sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        self.batch, _ = datums(self.tc.get_tokenizer(), types)
        self.prompt = types.ModelInput.from_ints(self.batch[0].model_input.to_ints()[:6])

    def step(self) -> None:
        self.tc.forward_backward(self.batch, "cross_entropy").result()
        self.tc.optim_step(self.types.AdamParams(learning_rate=5e-2)).result()

    def save(self, name: str) -> str:
        return self.tc.save_weights_for_sampler(name).result().path

    def sample(self, path: str) -> list:
        sampling = self.sc.create_sampling_client(model_path=path).result()
        params = self.types.SamplingParams(max_tokens=4, temperature=0.0)
        out = sampling.sample(self.prompt, 1, params).result().sequences[0]
        return [out.tokens, [round(x, 5) for x in out.logprobs]]

    def refused(self, name: str) -> str:
        try:
            self.save(name)
        except self.tinker.BadRequestError as e:
            return str(e)
        return ""

    def delete(self, path: str) -> None:
        rest = self.tinker.RestClient(base_url=f"http://127.0.0.1:{self.gw.port}", api_key=self.key)
        rest.delete_checkpoint_from_tinker_path(path).result()


async def stored_objects(nc) -> dict[str, str]:
    obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    infos = [info_from_object(o) for o in await obs.list(ignore_deletes=True)]
    return {i.name: i.kind for i in infos if i is not None}


async def test_named_sampler_saves_are_objects_loaded_when_sampled_and_bounded_per_tenant(nc, gateway, tmp_path):
    saver = await asyncio.to_thread(Saver, gateway, await key_for(nc, "acme"))
    await asyncio.to_thread(saver.step)
    first, second = await asyncio.to_thread(lambda: (saver.save("a"), saver.save("b")))
    refusal = await asyncio.to_thread(saver.refused, "c")
    assert "max_sampler_saves" in refusal and "(2" in refusal, refusal
    job = await job_of(nc, saver.tc.model_id)
    objects = await stored_objects(nc)
    assert {names.sampler_save_object(job.id, n) for n in "ab"} <= {k for k, v in objects.items() if v == "sampler"}
    kv = await nc.jetstream().key_value(names.TINKER_KV)
    record = msgspec.json.decode((await kv.get(model_key("acme", saver.tc.model_id))).value, type=ModelRecord)
    assert not record.samplers, record.samplers  # the record does not grow with them

    before = await asyncio.to_thread(saver.sample, first)
    await asyncio.to_thread(saver.step)  # the adapter moves on; the save does not
    await bus.request(nc, names.jobs_api("acme").pause, JobQuery(job.id), JobReply | Error)
    await wait_for(lambda: _state(nc, job.id, "paused"), timeout=60, what="the session paused")
    checkpoints = [k for k, v in (await stored_objects(nc)).items() if v == "checkpoint"]
    checkpoint = max(checkpoints, key=lambda k: int(k.rsplit("-", 1)[1]))  # the pause's
    await download_named(nc, checkpoint, tmp_path / "checkpoint.tar.gz")
    with tarfile.open(tmp_path / "checkpoint.tar.gz") as tar:
        carried = [m.name for m in tar.getmembers() if "sampler" in m.name]
    assert not carried, carried  # nor does a resume reload them: the sample fetches the one it needs
    assert await asyncio.to_thread(saver.sample, first) == before  # resumed, and the save read back from the store

    await asyncio.to_thread(saver.delete, first)  # its place and its object go
    assert names.sampler_save_object(job.id, "a") not in await stored_objects(nc)
    third = await asyncio.to_thread(saver.save, "c")
    listed = await asyncio.to_thread(lambda: saver.tinker.RestClient(
        base_url=f"http://127.0.0.1:{gateway.port}", api_key=saver.key).list_checkpoints(saver.tc.model_id).result())  # fmt: skip
    assert sorted(c.tinker_path for c in listed.checkpoints) == sorted([second, third])
    saver.sc.close("success")


async def _state(nc, job_id: str, state: str) -> bool:
    return (await get_job(nc, job_id)).state == state
