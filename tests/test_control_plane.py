"""The scheduler and agents over a real nats-server: submit, validate, place, queue, cancel, lose nodes, fail over."""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import pytest

from schemas import names
from schemas.jobs import Accepted, Rejected
from services.artifacts.service import ArtifactService
from services.scheduler.service import Scheduler
from tests.conftest import STACK_CONFIG, kv_keys, list_jobs, states_of, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs

INTERVAL = STACK_CONFIG.heartbeat_interval
CFG = STACK_CONFIG


def job(**kw) -> dict:
    base = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), "gpu_mib": 1000}
    base.update(kw)
    return base


async def test_submit_is_stored_before_the_reply(nc, stack):
    reply = await submit(nc, job(label="first"))
    assert isinstance(reply, Accepted)
    assert f"request.{reply.job}" in await kv_keys(nc)
    queued = await list_jobs(nc, state="queued")
    assert [j.id for j in queued] == [reply.job] and queued[0].label == "first"


@pytest.mark.parametrize(
    "payload, field",
    [
        (b"{not json", ""),
        (msgspec.json.encode({"base_dir": "/m", "data": pairs(1)}), "model"),
        (msgspec.json.encode(job(data=[])), "data"),
        (msgspec.json.encode(job(data=[{"q": "only a question"}])), "data[0].a"),
        (msgspec.json.encode(job(data=["not an object"])), "data[0]"),
        (msgspec.json.encode(job(gpu_mib="lots")), "gpu_mib"),
        (msgspec.json.encode(job(train={"batch_size": 0})), "train.batch_size"),
        (msgspec.json.encode(job(train={"learning_rate": -1})), "train.learning_rate"),
        (msgspec.json.encode(job(lora={"r": 0})), "lora.r"),
        (msgspec.json.encode(job(served_by="ollama")), "served_by"),
        (msgspec.json.encode(job(node="a node with spaces")), "node"),
        (msgspec.json.encode(job(base_dir="models/tiny")), "base_dir"),
        (msgspec.json.encode(job(colour="blue")), "colour"),
        (msgspec.json.encode(job(train={"eval_steps": 5})), "train.eval_steps"),
        # knowable at the door, though the trainer would only fail on them later
        (msgspec.json.encode(job(train={"seed": -1})), "train.seed"),
        (msgspec.json.encode(job(train={"seed": 2**64 - 1})), "train.seed"),
        (msgspec.json.encode(job(train={"max_steps": 10**15})), "train.max_steps"),
        (msgspec.json.encode(job(train={"warmup_steps": 10**15})), "train.warmup_steps"),
        (msgspec.json.encode(job(train={"max_steps": 10, "warmup_steps": 20})), "train.warmup_steps"),
        (msgspec.json.encode(job(train={"max_grad_norm": 1e308})), "train.max_grad_norm"),
        (msgspec.json.encode(job(base_dir="/")), "base_dir"),
        (msgspec.json.encode(job(base_dir="/models/ti\x00ny")), "base_dir"),
        (msgspec.json.encode(job(base_dir="/models/../etc")), "base_dir"),
        (msgspec.json.encode(job(data=[{"q": "  \t ", "a": "an answer"}])), "data[0].q"),
        (msgspec.json.encode(job(model=" ")), "model"),
        (msgspec.json.encode(job(lora={"target_modules": ["q proj"]})), "lora.target_modules[0]"),
        (msgspec.json.encode(job(lora={"target_modules": ["q_proj", "lm_head"]})), "lora.target_modules"),
    ],
)
async def test_bad_requests_are_rejected_with_the_field_and_nothing_is_stored(nc, stack, payload, field):
    reply = await submit(nc, payload)
    assert isinstance(reply, Rejected), reply
    assert reply.errors and reply.errors[0].field == field, reply.errors
    assert reply.errors[0].reason
    assert await kv_keys(nc) == []


async def test_a_job_no_known_gpu_could_hold_is_rejected_naming_the_largest(nc, stack, agents):
    agents.start("n1", gpus="8192,24576", interval=INTERVAL)
    await wait_nodes(nc, 1)
    reply = await submit(nc, job(gpu_mib=50_000))
    assert isinstance(reply, Rejected)
    assert reply.errors[0].field == "gpu_mib"
    assert "n1 device 1" in reply.errors[0].reason and "24576 MiB total" in reply.errors[0].reason
    assert await kv_keys(nc) == []


async def test_places_on_the_gpu_that_fits_and_runs_one_job_per_gpu(nc, stack, agents):
    agents.start("n1", gpus="8192,24576", interval=INTERVAL, hold_s=3.0)
    await wait_nodes(nc, 1)
    big = (await submit(nc, job(gpu_mib=16_000))).job
    j = await wait_state(nc, big, "running")
    assert (j.node, j.device) == ("n1", 1)
    small = [(await submit(nc, job(gpu_mib=4000))).job for _ in range(2)]
    first = await wait_state(nc, small[0], "running")
    assert first.device == 0
    done = await wait_state(nc, big, "succeeded", timeout=30)
    assert [a.kind for a in done.artifacts] == ["peft"]
    j = await wait_state(nc, small[1], ("running", "uploading", "succeeded"), timeout=30)
    assert j.node == "n1"
    # both GPUs busy: it waited for one of them. Read from the node's own reports (one clock), not from a look at
    # the queue after a sleep: on a busy machine the first jobs' 3 s could be over before that look
    ended = [
        min((e.ts for e in await states_of(nc, jid) if e.state in ("uploading", "succeeded")), default=math.inf)
        for jid in (big, small[0])  # (small[0] may be running still)
    ]
    started = min(e.ts for e in await states_of(nc, small[1]) if e.state == "preparing")
    assert started >= min(ended), (started, ended)


async def test_a_queued_job_is_assigned_when_a_heartbeat_shows_room(nc, stack, agents):
    waiting = (await submit(nc, job(gpu_mib=2000))).job
    await asyncio.sleep(0.5)
    assert (await wait_state(nc, waiting, "queued")).node is None
    t0 = time.monotonic()
    agents.start("late", gpus="4096", interval=INTERVAL)
    await wait_state(nc, waiting, ("assigned", "preparing", "running", "uploading", "succeeded"))
    assert time.monotonic() - t0 < 15
    await wait_state(nc, waiting, "succeeded")


async def test_pinned_jobs_wait_for_their_node(nc, stack, agents):
    agents.start("a", gpus="4096", interval=INTERVAL)
    await wait_nodes(nc, 1)
    pinned = (await submit(nc, job(node="b"))).job
    await asyncio.sleep(1.0)
    assert (await wait_state(nc, pinned, "queued")).node is None
    agents.start("b", gpus="4096", interval=INTERVAL)
    j = await wait_state(nc, pinned, "succeeded")
    assert j.node == "b"


async def test_priority_then_age(nc, stack, agents):
    low = (await submit(nc, job(priority=-5))).job
    old = (await submit(nc, job())).job
    high = (await submit(nc, job(priority=10))).job
    agents.start("one", gpus="4096", interval=INTERVAL, hold_s=0.2)
    await wait_state(nc, low, "succeeded", timeout=40)
    starts = {}
    for jid in (low, old, high):
        evs = await states_of(nc, jid)
        starts[jid] = min(e.ts for e in evs if e.state == "preparing")
    assert starts[high] < starts[old] < starts[low], starts


async def test_cancel_a_running_and_a_queued_job(nc, stack, agents):
    agents.start("n1", gpus="4096", interval=INTERVAL, hold_s=30)
    await wait_nodes(nc, 1)
    running = (await submit(nc, job())).job
    queued = (await submit(nc, job())).job
    await wait_state(nc, running, "running")
    from schemas.job_status import JobQuery, JobReply
    from services import bus

    r = await bus.request(nc, names.CANCEL, JobQuery(queued), JobReply)
    assert r.job.state == "cancelled"
    await bus.request(nc, names.CANCEL, JobQuery(running), JobReply)
    j = await wait_state(nc, running, "cancelled", timeout=10)
    assert j.message == "cancelled"
    assert (await wait_state(nc, queued, "cancelled")).node is None  # never placed after its cancel


async def test_stop_saves_and_ends_as_stopped(nc, stack, agents):
    agents.start("n1", gpus="4096", interval=INTERVAL, hold_s=30)
    jid = (await submit(nc, job())).job
    await wait_state(nc, jid, "running")
    from schemas.job_status import JobQuery, JobReply
    from services import bus

    await bus.request(nc, names.STOP, JobQuery(jid), JobReply)
    j = await wait_state(nc, jid, "stopped", timeout=15)
    assert [a.kind for a in j.artifacts] == ["peft"]


async def test_a_trainer_that_dies_fails_the_job_with_its_stderr(nc, stack, agents):
    agents.start("n1", gpus="4096", interval=INTERVAL, env={"HOLD_CRASH": "1"})
    jid = (await submit(nc, job())).job
    j = await wait_state(nc, jid, "failed")
    assert "training process exited unexpectedly (exit code 3)" in j.message
    assert "CUDA error: out of memory" in j.message


async def test_an_agent_killed_mid_job_fails_it_within_the_heartbeat_window(nc, stack, agents):
    agents.start("doomed", gpus="4096", interval=INTERVAL, hold_s=60)
    jid = (await submit(nc, job())).job
    await wait_state(nc, jid, "running")
    t0 = time.monotonic()
    agents.kill("doomed")
    j = await wait_state(nc, jid, "failed", timeout=10)
    took = time.monotonic() - t0
    assert "node doomed stopped answering at" in j.message
    assert took < CFG.window + 1.0, took


async def test_a_job_with_retries_is_requeued_to_another_node(nc, stack, agents):
    agents.start("doomed", gpus="4096", interval=INTERVAL, hold_s=60)
    jid = (await submit(nc, job(retries=1, node=None))).job
    await wait_state(nc, jid, "running")
    agents.start("spare", gpus="4096", interval=INTERVAL, hold_s=0.3)
    await wait_nodes(nc, 2)
    agents.kill("doomed")
    j = await wait_state(nc, jid, "succeeded", timeout=30)
    assert j.node == "spare" and j.attempt == 2
    msgs = [e.message for e in await states_of(nc, jid)]
    assert all("stopped answering" not in m for m in msgs)  # the re-queue is the scheduler's word, in the record


async def test_sigterm_hands_the_running_job_back(nc, stack, agents):
    agents.start("leaving", gpus="4096", interval=INTERVAL, hold_s=60)
    jid = (await submit(nc, job())).job
    await wait_state(nc, jid, "running")
    assert agents.terminate("leaving") == 0
    j = await wait_state(nc, jid, "queued", timeout=10)
    assert "shut down" in j.message


async def test_a_scheduler_restart_loses_nothing(nc, services, agents):
    sched, stop, task = await services.start(lambda c: Scheduler(c, CFG))
    await services.start(lambda c: ArtifactService(c))
    await asyncio.wait_for(sched.leading.wait(), 10)
    ids = [(await submit(nc, job(label=f"j{i}"))).job for i in range(5)]
    await services.stop(stop, task, hard=True)  # as abrupt as it gets in-process: no lease release, no drain
    sched2, *_ = await services.start(lambda c: Scheduler(c, CFG))
    await asyncio.wait_for(sched2.leading.wait(), 15)
    assert sorted(j.id for j in await list_jobs(nc, state="queued")) == sorted(ids)
    agents.start("n1", gpus="4096,4096", interval=INTERVAL, hold_s=0.2)
    for jid in ids:
        await wait_state(nc, jid, "succeeded", timeout=40)


async def test_two_schedulers_never_double_assign(nc, services, agents):
    s1, *_ = await services.start(lambda c: Scheduler(c, CFG, holder="s1"))
    s2, *_ = await services.start(lambda c: Scheduler(c, CFG, holder="s2"))
    await services.start(lambda c: ArtifactService(c))
    await wait_for(lambda: s1.leading.is_set() or s2.leading.is_set(), what="a leader")
    await asyncio.sleep(0.5)
    assert s1.leading.is_set() != s2.leading.is_set()
    for n in ("a", "b"):
        agents.start(n, gpus="4096,4096", interval=INTERVAL, hold_s=0.2)
    ids = [(await submit(nc, job())).job for _ in range(12)]
    for jid in ids:
        await wait_state(nc, jid, "succeeded", timeout=60)
    for jid in ids:
        preparing = [e for e in await states_of(nc, jid) if e.state == "preparing"]
        assert len(preparing) == 1, (jid, preparing)
