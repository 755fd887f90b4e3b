"""Co-training placed by the scheduler, on the real stack (nats-server, scheduler, artifact service, registry, an
agent as a process with the real trainer): four queued jobs of one tenant and one base are placed in one group on
one device; one is cancelled mid-way, one paused and resumed (it joins the group again), one fails with a NaN; the
others finish unaffected, each with its own artifacts, events and registry version. Jobs of another tenant, or one
that asks to train alone, are not put in the group."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from schemas import names
from schemas.events import CheckpointList, Progress
from schemas.jobs import SubmitReply
from schemas.job_status import JobList, JobListQuery, JobQuery, JobReply
from schemas.nodes import NodeList
from schemas.registry import AdapterReply, AdapterQuery
from services import bus
from services.artifacts.service import ArtifactService
from services.registry.service import RegistryService
from services.scheduler.core import SchedulerConfig
from services.scheduler.service import Scheduler
from tests.conftest import at_step, stream_events, wait_for
from tests.qa import pairs

pytestmark = pytest.mark.timeout(420)
ATTN, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
TRAIN = {"learning_rate": 0.005, "batch_size": 1, "max_seq_length": 128, "precision": "fp16"}


def job(tiny_model, **kw) -> dict:
    train = {**TRAIN, **kw.pop("train", {})}
    return {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "accelerator": "cpu", "train": train, **kw}


async def ask(nc, tenant: str, verb: str, message, reply_type):
    return await bus.request(nc, getattr(names.jobs_api(tenant), verb), message, reply_type)


async def status(nc, tenant: str, job_id: str):
    return (await ask(nc, tenant, "job", JobQuery(job_id), JobReply)).job


async def ended(nc, tenant: str, job_id: str, timeout: float = 240):
    async def check():
        j = await status(nc, tenant, job_id)
        return j if j.state in ("succeeded", "failed", "cancelled", "stopped") else None

    return await wait_for(check, timeout, interval=0.2, what=f"job {job_id} to end")


async def test_four_jobs_of_a_tenant_train_in_one_group_and_each_ends_on_its_own(services, nc, agents, tiny_model):
    cfg = SchedulerConfig(co_train="same-tenant", heartbeat_interval=0.25, misses=8)
    sched, *_ = await services.start(lambda c: Scheduler(c, cfg))
    await services.start(lambda c: ArtifactService(c))
    await services.start(lambda c: RegistryService(c))
    await asyncio.wait_for(sched.leading.wait(), 10)

    lora = {"r": 4, "alpha": 8, "target_modules": ATTN}
    requests = {
        "keeps": job(tiny_model, lora=lora, train={"max_steps": 80}, register={"name": "acme-keeps"}),
        "cancelled": job(tiny_model, lora={**lora, "r": 8}, train={"max_steps": 400}),
        "paused": job(
            tiny_model,
            lora={"r": 2, "alpha": 4, "target_modules": MLP},
            train={"max_steps": 40},
            register={"name": "acme-paused"},
        ),
        "nan": job(
            tiny_model,
            lora={"r": 1, "alpha": 8192, "target_modules": ATTN + MLP},
            train={"max_steps": 30, "learning_rate": 1.0, "max_grad_norm": 0.0},
        ),
    }
    ids = {}
    for name, request in requests.items():  # queued before any node: placed together when one comes
        reply = await ask(nc, "acme", "submit", request, SubmitReply)
        ids[name] = reply.job
    other = (await ask(nc, "globex", "submit", job(tiny_model, train={"max_steps": 4}), SubmitReply)).job
    alone = (await ask(nc, "acme", "submit", job(tiny_model, co_train=False, train={"max_steps": 4}), SubmitReply)).job

    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    placed = {n: await wait_for(lambda n=n: _grouped(nc, ids[n]), timeout=60, what=f"{n} placed") for n in ids}
    groups = {j.group for j in placed.values()}
    assert len(groups) == 1 and None not in groups, placed  # one group for the four
    group = groups.pop()
    assert {(j.node, j.device) for j in placed.values()} == {("box", -1)} or len(
        {j.device for j in placed.values()}
    ) == 1

    listed = await ask(nc, "acme", "jobs", JobListQuery(), JobList)
    assert {j.id: j.group for j in listed.jobs if j.id in ids.values()} == {i: group for i in ids.values()}
    await wait_for(lambda: _beat_groups(nc, group), timeout=20, what="the node listing the group's attempts")

    await wait_for(lambda: at_step(nc, ids["cancelled"], 2), timeout=120, what="the one to cancel at step 2")
    await ask(nc, "acme", "cancel", JobQuery(ids["cancelled"]), JobReply)
    await wait_for(lambda: at_step(nc, ids["paused"], 2), timeout=120, what="the one to pause at step 2")
    await ask(nc, "acme", "pause", JobQuery(ids["paused"]), JobReply)
    await wait_for(lambda: _in_state(nc, ids["paused"], "paused"), timeout=120, what="paused")
    saved = await ask(nc, "acme", "checkpoints", JobQuery(ids["paused"]), CheckpointList)
    assert saved.checkpoints, "the pause stored a checkpoint"
    await ask(nc, "acme", "resume", JobQuery(ids["paused"]), JobReply)

    final = {n: await ended(nc, "acme", i) for n, i in ids.items()}
    assert final["cancelled"].state == "cancelled"
    assert final["nan"].state == "failed" and "nan" in final["nan"].message.lower(), final["nan"].message
    for name in ("keeps", "paused"):
        j = final[name]
        assert j.state == "succeeded", (name, j.message, agents.log("box")[-3000:])
        assert [a.kind for a in j.artifacts][:1] == ["peft"]
    assert final["paused"].attempt == 2 and final["paused"].group is not None  # resumed, in a group again
    shas = {final[n].artifacts[0].sha256 for n in ("keeps", "paused")}
    assert len(shas) == 2  # each its own adapter
    for name in ("keeps", "paused"):  # each registered as its own version
        reply = await wait_for(lambda n=name: _registered(nc, f"acme-{n}"), timeout=30, what=f"acme-{name}@1")
        assert reply.versions[0].job == ids[name]
    steps = [e.step for e in await stream_events(nc, names.job(ids["keeps"], "box", tenant="acme").progress, _PROGRESS)]
    assert steps and steps[-1] == 80  # its own progress, to its own end

    for j in (other, alone):  # another tenant's job and one asking to be alone: never in the group
        done = await ended(nc, "globex" if j == other else "acme", j)
        assert done.state == "succeeded" and done.group != group, done


_PROGRESS = msgspec.json.Decoder(Progress)


async def _grouped(nc, job_id: str):
    j = (await bus.request(nc, names.GET_JOB, JobQuery(job_id), JobReply)).job
    return j if j.group and j.node else None


async def _in_state(nc, job_id: str, state: str):
    j = (await bus.request(nc, names.GET_JOB, JobQuery(job_id), JobReply)).job
    return j if j.state == state else None


async def _beat_groups(nc, group: str) -> bool:
    nodes = await bus.request(nc, names.LIST_NODES, b"{}", NodeList)
    return sum(a.group == group for n in nodes.nodes for a in n.attempts) >= 2


async def _registered(nc, name: str):
    reply = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name=name), AdapterReply)
    return reply if reply.versions else None
