"""The trainer lease bucket under races, with real agents and nats-server and the test as the scheduler (assignments
and controls sent straight to the nodes): a cancel that comes while the attempt's taking write is on its way (the
write lands after the cancel is done) still leaves the entry released, not held by an attempt that is gone; two
attempts that both waited out a frozen node's lease never run their trainers at once, the newer ending with the
entry; a co-trained job cancelled while it waits for its lease (it never joined its group) keeps nothing of the
group going: the group's process ends with its last job that trained; and an attempt that ends while a heartbeat's
renewal of its entry is on its way still leaves the entry released (before, the release's write was refused behind
the renewal, and the entry lapsed unreleased)."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest

from schemas import names, trainer_lease
from schemas.jobs import JobRequest
from schemas.nodes import AssignAccepted, Assignment, AssignReply, Control, ControlReply, Heartbeat
from services import bus
from services.procs import PID_FILE
from tests.conftest import wait_for
from tests.harness import Stack
from tests.harness.trainers import Trainers, cpu_s, holder
from tests.qa import pairs

pytestmark = pytest.mark.timeout(180)
LANDS_S = 1.5  # how late the node's writes to the trainer lease bucket land (below the agent's 2 s request)
RENEWAL_LANDS_S = 0.24  # just below the heartbeat interval (0.25 s): a renewal is on its way nearly all the time


def _request() -> JobRequest:
    return msgspec.convert({"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}, JobRequest)


async def _assign(nc, node: str, job: str, attempt: int, group: str | None = None) -> None:
    a = Assignment(job=job, device=0, attempt=attempt, request=_request(), group=group)
    reply = await bus.request(nc, names.node(node).assign, a, AssignReply, timeout=10)
    assert isinstance(reply, AssignAccepted), reply


async def test_a_cancel_while_the_taking_write_is_on_its_way_leaves_the_entry_released(tmp_path):
    async with Stack(tmp_path) as stack:
        stack.start_agent("n1", hold_s=30)
        nc = await nats.connect(stack.client_url)
        try:
            await wait_for(lambda: "agent n1 up" in stack.log("n1"), timeout=60, what="the agent up")
            stack.hold_writes("n1", prefixes=(f"$KV.{names.TRAINER_LEASES_KV}.",), mode="delay", delay_s=LANDS_S)
            trainers = Trainers([tmp_path / "agents" / "n1"], "j1")
            stop = asyncio.Event()
            watching = asyncio.create_task(trainers.watch(stop))
            try:
                await _assign(nc, "n1", "j1", 1)
                await wait_for(lambda: stack.proxy("n1").stats["delayed"] >= 1, what="the taking write on its way")
                control = Control("j1", "cancel", attempt=1)
                cancel = await bus.request(nc, names.node("n1").control, control, ControlReply)
                assert cancel.ok, cancel
                left = await wait_for(lambda: _released(nc, "j1"), timeout=15, what="the entry released by attempt 1")
            finally:
                stop.set()
                await watching
        finally:
            await nc.close()
    assert left == trainer_lease.Holder(job="j1", attempt=1, node="n1", lease_s=0.0, released=True), left
    assert not trainers.pids, f"a trainer of the cancelled attempt started: {trainers.pids}"


async def test_two_attempts_racing_for_a_lapsed_lease_never_train_at_once(nc, agents):
    for node in ("n1", "n2"):
        agents.start(node, hold_s=2.0)
    for node in ("n1", "n2"):
        await wait_for(lambda n=node: f"agent {n} up" in agents.log(n), timeout=60, what=f"{node} up")
    kv = await nc.jetstream().key_value(names.TRAINER_LEASES_KV)
    frozen = trainer_lease.Holder(job="j2", attempt=1, node="n0", lease_s=1.0)  # a node frozen mid-job
    await kv.put(trainer_lease.key("j2"), trainer_lease.encode(frozen))
    trainers = Trainers([agents.tmp / "n1", agents.tmp / "n2"], "j2")
    both: list[tuple[int, ...]] = []

    async def watch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            trainers.tick()
            alive = tuple(a for a, pid in trainers.pids.items() if cpu_s(pid) is not None)
            if len(alive) > 1:
                both.append(alive)
            await asyncio.sleep(0.02)

    stop = asyncio.Event()
    watching = asyncio.create_task(watch(stop))
    try:
        await asyncio.gather(_assign(nc, "n1", "j2", 2), _assign(nc, "n2", "j2", 3))
        last = await wait_for(lambda: _released(nc, "j2", 3), timeout=60, what="attempt 3 done with the entry")
    finally:
        stop.set()
        await watching
    assert not both, f"trainers of attempts {both[0]} computed at once"
    assert 3 in trainers.pids and last.node == "n2", (trainers.pids, last)


async def test_a_co_trained_job_cancelled_while_it_waits_for_its_lease_leaves_its_group(nc, agents):
    agents.start("n1", hold_s=2.0)
    await wait_for(lambda: "agent n1 up" in agents.log("n1"), timeout=60, what="the agent up")
    kv = await nc.jetstream().key_value(names.TRAINER_LEASES_KV)
    elsewhere = trainer_lease.Holder(job="j3", attempt=1, node="n0", lease_s=600.0)  # its attempt 1, frozen
    await kv.put(trainer_lease.key("j3"), trainer_lease.encode(elsewhere))
    await _assign(nc, "n1", "j3", 2, group="g1")
    await wait_for(lambda: "j3 attempt 2: waiting for attempt 1" in agents.log("n1"), what="j3 waiting for its lease")
    cancel = await bus.request(nc, names.node("n1").control, Control("j3", "cancel", attempt=2), ControlReply)
    assert cancel.ok, cancel
    await _assign(nc, "n1", "j4", 1, group="g1")  # trains in the group's process, and ends
    pid_files = agents.tmp / "n1" / "jobs"
    await wait_for(lambda: list(pid_files.glob(f"group-g1-*/{PID_FILE}")), timeout=30, what="the group's process")
    await wait_for(lambda: _released(nc, "j4"), timeout=60, what="j4 trained and ended")
    await wait_for(
        lambda: not list(pid_files.glob(f"group-g1-*/{PID_FILE}")), timeout=30, what="the group's process ended"
    )


async def test_an_attempt_ending_while_its_renewal_is_on_its_way_leaves_the_entry_released(tmp_path):
    async with Stack(tmp_path) as stack:
        stack.start_artifacts("arts")
        stack.start_agent("n1", hold_s=1.0)
        nc = await nats.connect(stack.client_url)
        beats: list[Heartbeat] = []

        async def heard(msg) -> None:
            beats.append(msgspec.json.decode(msg.data, type=Heartbeat))

        sub = await nc.subscribe(names.node("n1").heartbeat, cb=heard)
        try:
            await wait_for(lambda: "agent n1 up" in stack.log("n1"), timeout=60, what="the agent up")
            prefixes = (f"$KV.{names.TRAINER_LEASES_KV}.",)
            stack.hold_writes("n1", prefixes=prefixes, mode="delay", delay_s=RENEWAL_LANDS_S)
            await _assign(nc, "n1", "j5", 1)
            await wait_for(lambda: _lists(beats, "j5"), timeout=30, what="n1 running j5")
            seen = len(beats)
            await wait_for(  # its last state reported: the agent no longer lists the attempt
                lambda: len(beats) > seen and not _lists(beats[-1:], "j5"), timeout=60, what="n1 done with j5"
            )
            try:  # its release lands RENEWAL_LANDS_S late; one refused behind a renewal never does
                left = await wait_for(lambda: _released(nc, "j5"), timeout=10, what="j5's entry released")
            except AssertionError:
                left = await holder(nc, "j5")
        finally:
            await sub.unsubscribe()
            await nc.close()
    assert left is not None and left.released and (left.node, left.attempt) == ("n1", 1), f"left unreleased: {left}"


def _lists(beats: list[Heartbeat], job: str) -> bool:
    return any(a.job == job for b in beats for a in b.attempts)


async def _released(nc, job: str, attempt: int = 1):
    entry = await holder(nc, job)
    return entry if entry is not None and entry.released and entry.attempt == attempt else None
