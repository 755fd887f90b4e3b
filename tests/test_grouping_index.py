"""The co-training groups index (services/scheduler/grouping.py): a queued job finds the running group it fits best
by bisection over its bucket, and a group's place there follows its node's heartbeats and its members."""

from __future__ import annotations

import msgspec

from schemas.jobs import JobRequest
from schemas.nodes import Device, Heartbeat, RunningAttempt
from services.scheduler.config import SchedulerConfig
from services.scheduler.grouping import Groups, find_group, founder_key
from services.scheduler.fleet import Fleet

GPU = 81920


def request(gpu_mib: int = 8000, **more) -> JobRequest:
    return msgspec.convert({"model": "m", "base_dir": "/models/m", "gpu_mib": gpu_mib, **more}, JobRequest)


def beat(fleet: Fleet, node: str, free: list[int], running: dict[int, list[str]] | None = None, **hb) -> None:
    running = running or {}
    devices = [Device(index=i, total_mib=GPU, free_mib=f, jobs=running.get(i, [])) for i, f in enumerate(free)]
    attempts = [
        RunningAttempt(job=j, attempt=1, devices=[i], state="running") for i, jobs in running.items() for j in jobs
    ]
    fleet.heard(Heartbeat(node=node, agent_version="t", devices=devices, attempts=attempts, **hb))


def make(policy: str = "same-tenant", most: int = 8) -> tuple[Fleet, Groups, SchedulerConfig]:
    cfg = SchedulerConfig(co_train=policy, co_train_max=most)  # type: ignore[arg-type]
    fleet = Fleet()
    return fleet, Groups(fleet, cfg), cfg


def test_a_job_joins_the_fullest_group_it_fits_and_never_one_without_room():
    fleet, groups, cfg = make()
    beat(fleet, "a", [GPU, GPU])
    beat(fleet, "b", [GPU])
    groups.join("g-roomy", ("a", 0), "j1", request(8000), "acme")
    groups.join("g-full", ("a", 1), "j2", request(60000), "acme")
    groups.join("g-mid", ("b", 0), "j3", request(40000), "acme")
    found = find_group(groups, cfg, request(16000), "acme")  # rooms: roomy 73,920, mid 41,920, full 21,920
    assert found is not None and found[0].id == "g-full" and found[1] == 16000  # the least room left: best fit
    assert find_group(groups, cfg, request(30000), "acme")[0].id == "g-mid"  # type: ignore[index]
    assert find_group(groups, cfg, request(50000), "acme")[0].id == "g-roomy"  # type: ignore[index]
    assert find_group(groups, cfg, request(80000), "acme") is None
    assert find_group(groups, cfg, request(16000), "acme", kept={"a"})[0].id == "g-mid"  # type: ignore[index]


def test_tenants_policy_and_a_full_group_decide_who_may_join():
    fleet, groups, cfg = make(most=2)
    beat(fleet, "a", [GPU])
    groups.join("g", ("a", 0), "j1", request(), "acme")
    assert find_group(groups, cfg, request(), "globex") is None  # same-tenant: another tenant's group
    assert find_group(groups, cfg, request(co_train=False), "acme") is None  # it asked to train alone
    assert find_group(groups, cfg, request(), "acme", alone="its step ran out of memory in a group") is None
    assert find_group(groups, cfg, request(), "acme") is not None
    groups.join("g", ("a", 0), "j2", request(), "acme")
    assert find_group(groups, cfg, request(), "acme") is None  # --co-train-max 2
    groups.leave("g", "j2")
    assert find_group(groups, cfg, request(), "acme") is not None
    fleet_any, groups_any, cfg_any = make("any")
    beat(fleet_any, "a", [GPU])
    groups_any.join("g", ("a", 0), "j1", request(), "acme")
    assert find_group(groups_any, cfg_any, request(), "globex") is not None


def test_a_groups_room_follows_its_nodes_heartbeats():
    fleet, groups, cfg = make()
    beat(fleet, "a", [GPU])
    groups.join("g", ("a", 0), "j1", request(30000), "acme")
    assert find_group(groups, cfg, request(40000), "acme") is not None  # 81,920 free less j1's 30,000 pending
    beat(fleet, "a", [GPU - 30000 - 20000], running={0: ["j1"]})  # j1 runs (its memory now in free), an engine
    groups.node_heard("a")  # grew by 20,000
    assert find_group(groups, cfg, request(40000), "acme") is None
    assert find_group(groups, cfg, request(30000), "acme") is not None
    beat(fleet, "a", [GPU], draining=True)
    groups.node_heard("a")
    assert find_group(groups, cfg, request(1000), "acme") is None  # a draining node takes nobody
    fleet.forget("a")
    groups.node_heard("a")
    assert find_group(groups, cfg, request(1000), "acme") is None
    assert groups.leave("g", "j1") and groups.on(("a", 0)) is None and not groups.on_node


def test_a_job_pinned_to_a_node_looks_only_at_that_nodes_groups():
    fleet, groups, cfg = make()
    beat(fleet, "a", [GPU])
    beat(fleet, "b", [GPU])
    groups.join("ga", ("a", 0), "j1", request(70000), "acme")
    groups.join("gb", ("b", 0), "j2", request(1000), "acme")
    assert find_group(groups, cfg, request(8000, node="a"), "acme")[0].id == "ga"  # type: ignore[index]
    assert find_group(groups, cfg, request(20000, node="a"), "acme") is None  # b has room, but it is pinned to a


def test_queued_jobs_that_could_start_a_group_together_share_a_key():
    cfg = SchedulerConfig()
    assert founder_key(cfg, request(), "acme") == founder_key(cfg, request(16000), "acme")
    assert founder_key(cfg, request(), "acme") != founder_key(cfg, request(), "globex")
    assert founder_key(cfg, request(), "acme") != founder_key(cfg, request(priority=1), "acme")  # the yield rule
    assert founder_key(cfg, request(co_train=False), "acme") is None
    assert founder_key(SchedulerConfig(co_train="off"), request(), "acme") is None
