"""A queued job says why it waits, and what would change it (real scheduler, simulated GPU agents)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from schemas import names, nats_subjects
from schemas.jobs import Accepted
from schemas.job_status import JobQuery, JobWhy
from services import bus
from services.scheduler.core import TenantQuota
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import ROOT, get_job, list_jobs, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs

JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}


async def queued(nc, **job) -> str:
    reply = await submit(nc, {**JOB, **job})
    assert isinstance(reply, Accepted), reply
    return reply.job


async def says(nc, job_id: str, *words: str) -> str:
    async def check():
        message = (await get_job(nc, job_id)).message
        return message if all(w in message for w in words) else None

    return await wait_for(check, timeout=20, what=f"job {job_id}'s message to say {words}")


async def test_a_gpu_job_on_a_cpu_only_fleet_says_so_and_starts_when_a_gpu_joins(nc, stack, agents, nats_server):
    job = await queued(nc)  # before any node: (with nodes known, one no node could run is refused at submit)
    await says(nc, job, "no node is known yet", "start `jetlora agent`")
    agents.start("box", gpus=None, offer_cpu=True, hold_s=0.2)  # a node joins: the reason changes
    await says(nc, job, "0/1 nodes are available: 1 no GPU", "set accelerator to cpu or any to run on box's CPU now")
    why = await bus.request(nc, names.WHY, JobQuery(job), JobWhy)
    assert [(n.node, n.reason) for n in why.nodes] == [("box", "no GPU")] and "no GPU" in why.summary
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.cli", "why", job, "--nats", nats_server.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )  # in a thread: the scheduler answering it runs on this loop
    assert "0/1 nodes are available" in shown.stdout and "  box: no GPU" in shown.stdout, shown
    agents.start("gpu1", gpus="4096", hold_s=0.2)  # a GPU node joins: the job runs there
    assert (await wait_state(nc, job, ("succeeded",), timeout=30)).node == "gpu1"


async def test_a_busy_fleet_an_unknown_node_and_a_tenant_quota_each_say_theirs(nc, services, agents):
    sched, *_ = await services.start(
        lambda c: Scheduler(
            c,
            SchedulerConfig(
                co_train="off", heartbeat_interval=0.25, sharing="fifo", quotas={"acme": TenantQuota(devices=1)}
            ),  # fifo: devices:1 caps acme (under fair sharing it is acme's nominal share, and acme may borrow)
        )
    )
    await asyncio.wait_for(sched.leading.wait(), 10)
    agents.start("n1", gpus="4096,4096", hold_s=30)
    await wait_nodes(nc, 1)
    ghost = await queued(nc, node="ghost")
    await says(nc, ghost, "node ghost, which the job is pinned to, is not known", "submit it without `node`")
    first = await bus.request(nc, names.jobs_api("acme").submit, {**JOB, "gpu_mib": 1000}, Accepted)
    await wait_state(nc, first.job, ("running",), timeout=30)
    second = await bus.request(nc, names.jobs_api("acme").submit, {**JOB, "gpu_mib": 1000}, Accepted)
    await says(nc, second.job, "tenant acme holds 1 of its 1 devices (its quota)")
    other = await queued(nc, gpu_mib=1000)  # not acme's: takes the second GPU
    await wait_state(nc, other, ("running",), timeout=30)
    last = await queued(nc, gpu_mib=1000)
    await says(nc, last, "0/1 nodes are available: 1 busy", "it starts when a job there ends")


async def test_a_thousand_queued_jobs_are_not_written_again_on_every_pass(nc, stack):
    """Why a job waits is worked out when asked: later passes (each submission wakes one) write nothing of the
    thousand, and a listing still says why each waits."""
    jobs = [await queued(nc, node="ghost") for _ in range(200)]
    jobs += await asyncio.gather(*(queued(nc, node="ghost") for _ in range(800)))
    await says(nc, jobs[-1], "node ghost")
    js = nc.jetstream()
    stream = nats_subjects.kv(names.JOBS_KV).stream

    async def writes() -> int:
        return (await js.stream_info(stream)).state.last_seq

    before = await writes()
    for _ in range(5):  # five more passes, each with one new job of another kind
        await says(nc, await queued(nc, node="phantom"), "node phantom")
    written = await writes() - before
    print(f"KV writes for 5 passes over 1,000 queued jobs: {written}")
    assert written <= 5 * 2, written  # each new job's request and active mark; none of the thousand
    listed = await list_jobs(nc, state="queued", limit=1000)  # a page of the 1,005, each saying why it waits
    assert len(listed) == 1000 and all("waiting: node" in j.message for j in listed)


async def test_too_little_free_memory_and_a_node_kept_for_a_multi_device_job_each_say_theirs(nc, stack, agents):
    agents.start("small", gpus="8192/2048", hold_s=30)  # a serving engine holds most of its one GPU
    agents.start("pair", gpus="4096,4096", hold_s=30)
    await wait_nodes(nc, 2)
    big = await queued(nc, gpu_mib=6000)
    await says(
        nc, big, "0/2 nodes are available", "1 insufficient free memory (need 6,000 MiB, largest free", "1 too small"
    )
    one = await queued(nc, gpu_mib=1000, node="pair")
    await wait_state(nc, one, ("running",), timeout=30)
    gang = await queued(nc, gpu_mib=1000, devices=2, node="pair")
    await says(nc, gang, "0/1 nodes are available: 1 busy")
    after = await queued(nc, gpu_mib=1000, node="pair")  # the free GPU is kept for the gang
    await says(nc, after, "1 kept for multi-device job " + gang)
