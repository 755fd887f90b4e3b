"""Co-training by content, from outside: an agent (`jetlora agent --offer-cpu --model A --model B --model C`) with one
CPU device; two long jobs on base A start a group there. A job on C, a byte-for-byte copy of A in another directory,
submitted while the group runs, joins the group; a job on B, A with one value of its weights changed, never does.

The group is founded on the agent's first heartbeats, which may come before the agent has hashed its bases: the
group is then keyed by A's directory until a heartbeat says A's digest (the index test below holds that case every
time; from outside it comes about in about two runs of three)."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from schemas.jobs import JobRequest, SubmitReply
from schemas.memory import ModelShape
from schemas.nodes import CPU_DEVICE, Device, Heartbeat, RunningAttempt
from services.scheduler.core import SchedulerConfig
from services.scheduler.fleet import Fleet
from services.scheduler.grouping import Groups, find_group
from tests.conftest import get_job, start_stack, submit, wait_for, wait_state
from tests.qa import pairs
from tests.test_co_train_identity import change_one_value

pytestmark = pytest.mark.timeout(300)
TRAIN = {"learning_rate": 0.005, "batch_size": 1, "max_seq_length": 64, "logging_steps": 1}


def job(base: Path, steps: int) -> dict:
    return {
        "model": "tiny",
        "base_dir": str(base),
        "data": pairs(),
        "accelerator": "cpu",
        "train": {**TRAIN, "max_steps": steps},
    }


async def placed(nc, job_id: str):
    j = await get_job(nc, job_id)
    return j if j.node else None


async def test_a_copy_of_the_groups_base_joins_it_and_a_changed_one_never_does(
    services, nc, agents, tiny_model, tmp_path
):
    a = Path(shutil.copytree(tiny_model, tmp_path / "A"))
    b = Path(shutil.copytree(tiny_model, tmp_path / "B"))
    change_one_value(b)
    c = Path(shutil.copytree(tiny_model, tmp_path / "C"))
    await start_stack(services, SchedulerConfig(co_train="same-tenant", heartbeat_interval=0.25, misses=8))
    longs = []
    for _ in range(2):  # queued before the node comes: placed together, as a group, on its first heartbeat
        reply = await submit(nc, job(a, 400))
        assert isinstance(reply, SubmitReply) and reply.job, reply
        longs.append(reply.job)
    models = ("--model", str(a), "--model", str(b), "--model", str(c))
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25, extra=models)
    first = await wait_for(lambda: placed(nc, longs[0]), timeout=60, what="the first job on A placed")
    group = first.group
    assert group is not None, first
    await wait_state(nc, longs[1], "running", timeout=60)
    assert (await get_job(nc, longs[1])).group == group

    copy = (await submit(nc, job(c, 4))).job
    changed = (await submit(nc, job(b, 4))).job
    joined = await wait_state(nc, copy, ("succeeded", "failed"), timeout=120)
    assert joined.state == "succeeded" and joined.group == group, joined
    for j in longs:  # the copy joined the group while it ran, and left it at its end
        assert (await get_job(nc, j)).state == "running"
    groups_of_changed: set[str | None] = set()

    async def changed_ended():
        j = await get_job(nc, changed)
        groups_of_changed.add(j.group)
        return j if j.state in ("succeeded", "failed") else None

    other = await wait_for(
        changed_ended, timeout=60, what="the job on B ended", progress=lambda: len(groups_of_changed)
    )
    assert other.state == "succeeded", other
    assert group not in groups_of_changed, f"the job on B was placed in the group of A: {other}"
    for j in longs:
        assert (await get_job(nc, j)).state == "succeeded"


def test_a_group_founded_before_its_base_was_hashed_is_found_by_content_once_it_is():
    """The scheduler's index (services/scheduler/grouping.py): the agent's first heartbeat advertises A with no digest
    yet, and the group founded then is keyed by A's directory; once a heartbeat says A's digest, a job on C (same
    digest, another directory) finds the group, and one on B (another digest) does not."""
    cfg = SchedulerConfig(co_train="same-tenant")
    fleet = Fleet()
    groups = Groups(fleet, cfg)
    shapes = {d: ModelShape(**SHAPE, dir=d) for d in ("/m/A", "/m/B", "/m/C")}

    def beat(digests: dict[str, str], running: list[str]) -> None:
        models = [msgspec.structs.replace(shape, digest=digests.get(d, "")) for d, shape in shapes.items()]
        cpu = Device(index=CPU_DEVICE, kind="cpu", total_mib=64000, free_mib=32000, jobs=running)
        attempts = [RunningAttempt(job=j, attempt=1, devices=[CPU_DEVICE], state="running") for j in running]
        fleet.heard(Heartbeat(node="box", agent_version="t", devices=[cpu], attempts=attempts, models=models))
        groups.node_heard("box")

    beat({}, [])  # the first heartbeat: nothing hashed yet
    groups.join("g", ("box", CPU_DEVICE), "a1", on("/m/A"), None)
    groups.join("g", ("box", CPU_DEVICE), "a2", on("/m/A"), None)
    beat({"/m/A": "sha256:a", "/m/C": "sha256:a", "/m/B": "sha256:b"}, ["a1", "a2"])
    found = find_group(groups, cfg, on("/m/C"), None)
    assert found is not None and found[0].id == "g", "a job on a copy of the group's base does not find the group"
    assert find_group(groups, cfg, on("/m/A"), None) is not None  # nor would one on the same directory, before
    assert find_group(groups, cfg, on("/m/B"), None) is None  # another content: never


SHAPE = dict(params=1000, layers=2, hidden=64, intermediate=128, heads=4, kv_heads=4, head_dim=16, vocab=100)


def on(base: str) -> JobRequest:
    return msgspec.convert({"model": "tiny", "base_dir": base, "accelerator": "cpu", "gpu_mib": 100}, JobRequest)
