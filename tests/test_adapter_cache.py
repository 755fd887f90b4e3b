"""A node's adapter cache keeps its byte budget, least recently used removed first, and never removes what an
engine serves, what a load holds, or what was just fetched; the agent evicts in a thread, off its event loop."""

from __future__ import annotations

import os

import pytest

from services.agent.adapter_cache import AdapterCache

MIB = 2**20


def adapter(root, sha: str, mib: int, age_s: int) -> None:
    """An adapter directory of `mib` MiB, last used `age_s` seconds ago."""
    d = root / sha / "peft"
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(b"\0" * (mib * MIB))
    past = os.stat(root / sha).st_mtime - age_s
    os.utime(root / sha, (past, past))


@pytest.fixture
def root(tmp_path):
    for sha, age in (("old", 40), ("served", 30), ("held", 20), ("recent", 10), ("fetched", 0)):
        adapter(tmp_path, sha, 1, age)
    (tmp_path / "loaded.json").write_text("{}")  # the rollout's state file is not an adapter
    return tmp_path


def present(root) -> set[str]:
    return {d.name for d in root.iterdir() if d.is_dir()}


def test_the_least_recently_used_go_first_until_the_budget_holds(root):
    cache = AdapterCache(root, 3 * MIB + MIB // 2)
    assert cache.evict(served={"served"}, fetched="fetched") == ["old", "held"]
    assert present(root) == {"served", "recent", "fetched"} and (root / "loaded.json").is_file()


def test_what_engines_serve_loads_hold_and_a_fetch_brought_stay_even_over_budget(root, caplog):
    cache = AdapterCache(root, 0)
    with cache.holding("held"):
        assert cache.evict(served={"served"}, fetched="fetched") == ["old", "recent"]
    assert present(root) == {"served", "held", "fetched"}
    assert "over its 0 MiB budget" in caplog.text and "--adapter-cache-mib" in caplog.text
    assert cache.evict(served={"served"}) == ["held", "fetched"]  # the hold is over: it may go now


def test_an_adapter_used_again_is_the_last_to_go(root):
    cache = AdapterCache(root, 4 * MIB)
    cache.used("old")
    assert cache.evict(served=set()) == ["served"]
    assert "old" in present(root)


def test_a_node_that_fetched_nothing_yet_has_nothing_to_remove(tmp_path):
    assert AdapterCache(tmp_path / "adapters", 0).evict(served=set()) == []


async def test_the_agent_evicts_off_its_loop_and_a_half_removed_directory_goes_too(root):
    (root / ".evicting-crashed").mkdir()  # what an agent killed half way through a removal left
    cache = AdapterCache(root, 0)
    with cache.holding("held"):
        assert await cache.evict_async(served={"served"}, fetched="fetched") == ["old", "recent"]
    assert present(root) == {"served", "held", "fetched"} and not cache.doomed
    await cache.settled("old")  # nothing is being removed now: it returns at once
