"""Submit through the scheduler; a CPU agent really trains; events replay from the stream; artifacts are stored."""

from __future__ import annotations

import asyncio

import gguf
import msgspec

from schemas import names
from schemas.events import Progress, StateChange
from schemas.jobs import Accepted
from services.transfer.download import download, safe_extract
from services.artifacts.service import ArtifactService
from services.scheduler.service import Scheduler, SchedulerConfig
from services.cli.watch import follow
from tests.conftest import stream_events, submit, wait_nodes, wait_state
from tests.qa import pairs

PROGRESS = msgspec.json.Decoder(Progress)


async def test_a_job_trains_on_a_cpu_agent_and_stores_peft_and_gguf(nc, services, agents, tiny_model, tmp_path):
    sched, *_ = await services.start(lambda c: Scheduler(c, SchedulerConfig(co_train="off", heartbeat_interval=0.5)))
    art, *_ = await services.start(lambda c: ArtifactService(c))
    await asyncio.wait_for(sched.leading.wait(), 10)
    agents.start("cpu-node", gpus=None, offer_cpu=True, trainer=None, interval=0.5)
    reply = await submit(
        nc,
        {
            "model": "tiny",
            "base_dir": str(tiny_model),
            "data": pairs(),
            "accelerator": "cpu",
            "served_by": "llamacpp",
            "train": {"max_steps": 40, "learning_rate": 0.01, "batch_size": 1, "max_seq_length": 128},
        },
    )
    assert isinstance(reply, Accepted), reply
    job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=300)
    assert job.state == "succeeded", (job.message, agents.log("cpu-node")[-3000:])
    assert sorted(a.kind for a in job.artifacts) == ["gguf", "peft", "tensorboard"]
    assert job.node == "cpu-node" and job.device == -1

    # a late subscriber replays the whole run from the stream's start
    events = [ev async for ev in follow(nc, reply.job)]
    progress = [e for e in events if isinstance(e, Progress)]
    states = [e.state for e in events if isinstance(e, StateChange)]
    assert states == ["preparing", "running", "uploading", "succeeded"]
    assert [p.step for p in progress] == list(range(1, 41))
    assert progress[-1].loss < 0.5 * progress[0].loss

    peft_tar = tmp_path / "adapter.tar.gz"
    await download(nc, reply.job, "peft", peft_tar)
    adapter = safe_extract(peft_tar, tmp_path / "adapter")
    assert (adapter / "adapter_model.safetensors").exists() and (adapter / "adapter_config.json").exists()
    await download(nc, reply.job, "gguf", tmp_path / "adapter.gguf")
    reader = gguf.GGUFReader(tmp_path / "adapter.gguf")
    assert any(t.name == "blk.0.attn_q.weight.lora_a" for t in reader.tensors)


async def test_a_job_whose_node_dies_resumes_on_another_from_its_checkpoint(nc, services, agents, tiny_model):
    sched, *_ = await services.start(
        lambda c: Scheduler(c, SchedulerConfig(co_train="off", heartbeat_interval=0.25, misses=4))
    )
    await services.start(lambda c: ArtifactService(c))
    await asyncio.wait_for(sched.leading.wait(), 10)
    agents.start("first", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    train = {"max_steps": 100, "learning_rate": 0.005, "batch_size": 1, "max_seq_length": 128, "save_steps": 10}
    reply = await submit(
        nc,
        {
            "model": "tiny",
            "base_dir": str(tiny_model),
            "data": pairs(),
            "accelerator": "cpu",
            "retries": 1,
            "train": train,
        },
    )
    job_id = reply.job

    async def checkpointed():
        from tests.conftest import get_job

        j = await get_job(nc, job_id)
        return j if "checkpoint at step" in j.message else None

    from tests.conftest import wait_for

    await wait_for(checkpointed, timeout=180, what="a stored checkpoint")
    agents.start("second", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 2)
    agents.kill("first")
    job = await wait_state(nc, job_id, ("succeeded", "failed"), timeout=300)  # a busy machine trains slowly
    assert job.state == "succeeded", (job.message, agents.log("second")[-2000:])
    assert job.node == "second" and job.attempt == 2

    events = [ev async for ev in follow(nc, job_id)]
    second = [e for e in events if isinstance(e, StateChange) and e.attempt == 2]
    assert any("resuming from checkpoint" in e.message for e in second)
    assert any("resumed from step" in e.message for e in second if e.state == "running")
    resumed = [p.step for p in await stream_events(nc, names.job(job_id, "second").progress, PROGRESS)]
    assert resumed[0] > 1  # the second node did not start again from step 0
    assert resumed[-1] == 100
