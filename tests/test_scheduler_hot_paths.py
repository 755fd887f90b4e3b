"""What the scheduler's per-heartbeat and per-placement paths keep answering once made cheaper (#61 item 3): a
heartbeat says it made room exactly when a device went into the free index (the index itself unchanged by a repeat
heartbeat, and rebuilt when a node stops draining); best fit looks past any number of devices or groups too small
without walking them; a member joining its group again changes nothing; the nodes a placement pass looks at are
either view's, their union never built."""

from __future__ import annotations

import msgspec

from schemas.jobs import JobRequest
from schemas.nodes import Device, Heartbeat
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import Fleet
from services.scheduler.grouping import SCAN, EitherNodes, Groups, find_group
from services.scheduler.tenancy import TenantBook
from schemas.job_status import JobStatus

GPU = 81920


def request(gpu_mib: int = 8000) -> JobRequest:
    return msgspec.convert({"model": "m", "base_dir": "/models/m", "gpu_mib": gpu_mib}, JobRequest)


def heartbeat(node: str, free: list[int], jobs: dict[int, list[str]] | None = None, **more) -> Heartbeat:
    jobs = jobs or {}
    devices = [Device(index=i, total_mib=GPU, free_mib=f, jobs=jobs.get(i, [])) for i, f in enumerate(free)]
    return Heartbeat(node=node, agent_version="t", devices=devices, **more)


def test_a_heartbeat_made_room_exactly_when_a_device_went_into_the_free_index():
    fleet = Fleet()
    assert fleet.heard(heartbeat("n", [GPU, GPU], jobs={1: ["j"]}))  # a new node with a free device
    assert not fleet.heard(heartbeat("n", [GPU, GPU], jobs={1: ["j"]}))  # the same again: nothing new
    assert fleet.find(GPU, "gpu") == ("n", 0)
    assert fleet.heard(heartbeat("n", [GPU, GPU]))  # j ended: device 1 is free
    assert not fleet.heard(heartbeat("n", [GPU, GPU - 100], jobs={1: ["k"]}))  # taken: no room made
    assert fleet.heard(heartbeat("n", [GPU, GPU - 100]))  # freed with less memory: still room
    fleet.reserve(("n", 0), "placed")
    assert not fleet.heard(heartbeat("n", [GPU, GPU - 100]))  # unchanged: the reservation keeps device 0 out
    assert fleet.find(GPU - 100, "gpu") == ("n", 1)
    fleet.release(("n", 0), "placed")
    assert fleet.find(GPU, "gpu") == ("n", 0)  # a release indexes the device as its last heartbeat has it


def test_a_node_that_stops_draining_has_its_unchanged_devices_indexed_again():
    fleet = Fleet()
    fleet.heard(heartbeat("n", [GPU]))
    assert not fleet.heard(heartbeat("n", [GPU], draining=True)) and fleet.find(1, "gpu") is None
    assert fleet.heard(heartbeat("n", [GPU])) and fleet.find(1, "gpu") == ("n", 0)
    assert fleet.free_nodes() == {"n"}


def test_best_fit_finds_the_device_past_thousands_too_small_and_skips_kept_nodes():
    fleet = Fleet()
    for i in range(300):  # 2,400 devices with 1,000 MiB free each, before the two that fit
        fleet.heard(heartbeat(f"small{i:03d}", [1000] * 8))
    fleet.heard(heartbeat("big-a", [50000]))
    fleet.heard(heartbeat("big-b", [40000]))
    assert fleet.find(30000, "gpu") == ("big-b", 0)  # the least free that fits
    assert fleet.find(30000, "gpu", held={"big-b"}) == ("big-a", 0)
    assert fleet.find(60000, "gpu") is None
    assert fleet.find(500, "gpu") == ("small000", 0)


def test_a_group_past_more_full_groups_than_one_scan_is_found():
    cfg = SchedulerConfig(co_train="same-tenant", co_train_max=8)
    fleet = Fleet()
    groups = Groups(fleet, cfg)
    for i in range(3 * SCAN):  # groups with 1,920 MiB of room each, before the one with room
        fleet.heard(heartbeat(f"full{i:03d}", [GPU]))
        groups.join(f"g-full{i}", (f"full{i:03d}", 0), f"j{i}", request(GPU - 1920), "acme")
    fleet.heard(heartbeat("roomy", [GPU]))
    groups.join("g-roomy", ("roomy", 0), "jr", request(8000), "acme")
    found = find_group(groups, cfg, request(16000), "acme")
    assert found is not None and found[0].id == "g-roomy" and found[1] == 16000
    assert find_group(groups, cfg, request(16000), "acme", kept={"roomy"}) is None


def test_a_member_joining_again_changes_neither_the_group_nor_its_room():
    cfg = SchedulerConfig(co_train="same-tenant", co_train_max=8)
    fleet = Fleet()
    groups = Groups(fleet, cfg)
    fleet.heard(heartbeat("a", [GPU]))
    groups.join("g", ("a", 0), "j1", request(30000), "acme", need=30000)  # placed: what best fit found it needs
    groups.join("g", ("a", 0), "j1", request(30000), "acme")  # its assignment stored: the same member again
    assert groups.by_id["g"].members == {"j1": 30000}
    assert find_group(groups, cfg, request(51920), "acme") is not None  # 81,920 less 30,000 pending, once
    assert find_group(groups, cfg, request(51921), "acme") is None
    assert groups.leave("g", "j1") and not groups.by_id and groups.on(("a", 0)) is None


def test_either_nodes_is_the_union_of_two_live_views():
    free, grouped = {"a": 1, "b": 1}, {"b": 1, "c": 1}
    either = EitherNodes(free.keys(), grouped.keys())
    assert sorted(either) == ["a", "b", "c"] and "c" in either and "d" not in either
    assert len(either) >= 3  # at most the two sizes added: what walking the smaller side needs
    grouped["d"] = 1  # live: a node that starts a group is in it at once
    assert "d" in either and sorted(either) == ["a", "b", "c", "d"]


def test_a_tenants_waiting_sizes_count_in_and_out_to_nothing():
    book = TenantBook()
    queued = JobStatus(state="queued")
    for job, devices in (("j1", 1), ("j2", 2), ("j3", 1)):
        book.count(job, "acme", devices, None, queued, 1)
    assert book.sizes["acme"] == {1: 2, 2: 1} and book.smallest("acme") == 1
    for job, devices in (("j1", 1), ("j3", 1)):
        book.count(job, "acme", devices, None, queued, -1)
    assert book.smallest("acme") == 2 and book.queued["acme"] == 1
    book.count("j2", "acme", 2, None, queued, -1)
    assert book.smallest("acme") is None and book.tenants() == set()


def test_an_admins_quota_is_the_same_whichever_time_it_is_asked():
    cfg = SchedulerConfig(admin_weight=3.0)
    first = cfg.quota(None)
    assert first is cfg.quota(None) and first.queued is None and first.priority is None and first.weight == 3.0
    assert SchedulerConfig(admin_weight=2.0).quota(None).weight == 2.0  # made per weight, never shared across
