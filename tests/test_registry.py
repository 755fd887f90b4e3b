"""The adapter registry and its rollout (real nats-server, agents as processes): versions never overwritten,
promote / rollback / retire flip what every node's engine serves, a late agent converges, a corrupted or
unservable adapter is refused on every node with the reason."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from schemas import names
from schemas.jobs import Accepted, Error
from schemas.registry import (
    AdapterList,
    AdapterListQuery,
    AdapterQuery,
    AdapterReply,
    AdapterVersion,
    AliasRequest,
    PromoteRequest,
    RegisterRequest,
    StoredFile,
)
from services import bus
from services.registry.store import AdapterRegistry
from tests.conftest import ROOT, beating, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs


async def trained(nc, **request) -> str:
    """A job of the stand-in trainer that succeeded (its artifacts are in the store)."""
    reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), **request})
    assert isinstance(reply, Accepted), reply
    job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=60)
    assert job.state == "succeeded", job.message
    return reply.job


async def show(nc, name: str) -> AdapterReply:
    return await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name=name), AdapterReply)


async def serving(nc, name: str, expected: dict[str, tuple[int, str]], saying: str = "") -> None:
    """Until each node in `expected` reports (version, state) for the adapter, its message `saying` that."""

    async def check():
        reply = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name=name), AdapterReply | Error)
        if isinstance(reply, Error):
            return False
        seen = {n.node: (n.version, n.state) for n in reply.nodes if saying in n.message}
        return all(seen.get(node) == want for node, want in expected.items())

    await wait_for(check, timeout=60, what=f"{name} on {expected}")


def engine(tmp_path, node: str, model: str = "tiny", *more: str) -> tuple[str, ...]:
    return ("--engine", f"vllm-dir={tmp_path / ('engine-' + node)}", "--engine-model", model, *more)


def placed(tmp_path, node: str, name: str):
    path = tmp_path / f"engine-{node}" / name / "adapter_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


async def test_promote_rollback_and_retire_flip_what_every_node_serves(stack, nc, agents, tmp_path, nats_server):
    agents.start("trainer", gpus="4096", hold_s=0.2)
    await wait_nodes(nc, 1)  # the node with a GPU is known before any job is submitted
    agents.start("a1", gpus=None, extra=engine(tmp_path, "a1"))
    agents.start(
        "a2", gpus=None, extra=engine(tmp_path, "a2", "tiny", "--adapter-cache-mib", "0")
    )  # keeps only what it serves
    agents.start("other", gpus=None, extra=engine(tmp_path, "other", "another-model"))
    await wait_nodes(nc, 1)
    first = await trained(nc, register={"name": "support", "promote": True})
    await serving(nc, "support", {"a1": (1, "placed"), "a2": (1, "placed")})
    # placed for vLLM's filesystem resolver, which loads an adapter only for the model it serves
    assert placed(tmp_path, "a1", "support") == {"r": 1, "base_model_name_or_path": "tiny"}
    assert placed(tmp_path, "other", "support") is None

    second = await trained(nc)
    reply = await bus.request(nc, names.ADAPTERS.register, RegisterRequest(name="support", job=second), AdapterReply)
    assert [v.version for v in reply.versions] == [1, 2] and reply.alias.current == 1  # registered, not promoted
    assert [v.job for v in reply.versions] == [first, second]
    # registered for a name they serve: fetched ahead of its promotion, which then fetches nothing
    staged = {n: agents.tmp / n / "adapters" / reply.versions[1].peft.sha256 / "peft" for n in ("a1", "a2")}
    await wait_for(lambda: all(p.is_dir() for p in staged.values()), timeout=30, what="v2 staged on a1 and a2")
    inodes = {n: p.stat().st_ino for n, p in staged.items()}
    await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="support", version=2, expect=1), AdapterReply)
    await serving(nc, "support", {"a1": (2, "placed"), "a2": (2, "placed")})
    assert {n: p.stat().st_ino for n, p in staged.items()} == inodes
    v1 = {n: agents.tmp / n / "adapters" / reply.versions[0].peft.sha256 for n in ("a1", "a2")}
    await wait_for(lambda: not v1["a2"].exists(), timeout=30, what="a2 (budget 0) to remove v1, no longer served")
    assert v1["a1"].is_dir()  # a1's budget holds both
    assert "staged support@2" in agents.log("a1") and "staged support" not in agents.log("other")
    agents.start("late", gpus=None, extra=engine(tmp_path, "late"))  # started after the promote: converges
    await serving(nc, "support", {"late": (2, "placed")})
    listed = await bus.request(nc, names.ADAPTERS.list, AdapterListQuery(base_model="tiny"), AdapterList)
    assert [a.alias.name for a in listed.adapters] == ["support"]
    assert (await bus.request(nc, names.ADAPTERS.list, AdapterListQuery(base_model="x"), AdapterList)).adapters == []
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.cli", "adapters", "show", "support", "--nats", nats_server.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert shown.stdout.startswith("support: serves support@2; versions 1-2; before: 1"), shown.stdout + shown.stderr
    assert "node late [vllm-dir" in shown.stdout and "@2 placed" in shown.stdout

    back = await bus.request(nc, names.ADAPTERS.rollback, AliasRequest(name="support"), AdapterReply)
    assert back.alias.current == 1 and back.alias.history == []
    await serving(nc, "support", {"a1": (1, "placed"), "a2": (1, "placed"), "late": (1, "placed")})
    retired = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.cli", "adapters", "retire", "support", "--nats", nats_server.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert retired.returncode == 0 and retired.stdout.startswith("support: retired"), retired.stdout + retired.stderr
    await serving(nc, "support", {"a1": (1, "unloaded"), "a2": (1, "unloaded"), "late": (1, "unloaded")})
    assert all(placed(tmp_path, n, "support") is None for n in ("a1", "a2", "late"))
    assert "other" not in {n.node for n in (await show(nc, "support")).nodes}  # not its base model

    # an agent that restarts converges without loading anything twice
    await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="support", version=2), AdapterReply)
    await serving(nc, "support", {"a1": (2, "placed")})

    def loads() -> int:
        return sum(1 for line in agents.log("a1").splitlines() if "support@2 on" in line and ": loading" in line)

    def looked() -> int:
        return agents.log("a1").count("support@2 is served by")

    # the log is the first life's too, which says so again whenever its registry watch replays the aliases
    before, looked_before = loads(), looked()
    agents.terminate("a1")
    agents.start("a1", gpus=None, extra=engine(tmp_path, "a1"))
    await wait_for(lambda: looked() > looked_before, timeout=30, what="the restarted agent to look at support@2")
    assert loads() == before == 2 and placed(tmp_path, "a1", "support")["r"] == 1


async def test_versions_are_never_overwritten_and_concurrent_promotes_have_one_winner(stack, nc, nats_server):
    registry = AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))
    file = StoredFile(name="j/peft", sha256="0" * 64, size=1)
    draft = AdapterVersion(
        name="race", version=1, job="j", base_model="tiny", peft=file, r=8, alpha=16, target_modules=["q_proj"]
    )
    made = await asyncio.gather(*(registry.add_version(draft) for _ in range(8)))
    assert sorted(v.version for v in made) == list(range(1, 9))  # concurrent registrations: each its own number
    kv = await nc.jetstream().key_value(names.ADAPTERS_KV)
    from nats.js.errors import KeyWrongLastSequenceError

    with pytest.raises(KeyWrongLastSequenceError):  # a version key is created once, never written again
        await kv.create(names.adapter_version_key("race", 3), b"{}")
    promotes = [
        bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="race", version=v, expect=0), AdapterReply | Error)
        for v in range(1, 9)
    ]
    replies = await asyncio.gather(*promotes)
    winners = [r for r in replies if isinstance(r, AdapterReply)]
    assert len(winners) == 1 and all(
        "another change came first" in r.error or "changed while" in r.error for r in replies if isinstance(r, Error)
    )
    assert (await show(nc, "race")).alias.current == winners[0].alias.current

    # what the caller saw is the alias's change count: a 1 -> 2 -> 1 in between refuses the change, where comparing
    # the version it serves would let it pass
    seen = await show(nc, "race")
    await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="race", version=5), AdapterReply)
    await bus.request(nc, names.ADAPTERS.rollback, AliasRequest(name="race"), AdapterReply)
    assert (await show(nc, "race")).alias.current == seen.alias.current
    stale = await bus.request(
        nc,
        names.ADAPTERS.promote,
        PromoteRequest(name="race", version=7, expect_changes=seen.alias.changes),
        AdapterReply | Error,
    )
    assert isinstance(stale, Error) and "changed since you looked" in stale.error, stale
    assert (await show(nc, "race")).alias.current == seen.alias.current
    now = (await show(nc, "race")).alias.changes
    assert now == seen.alias.changes + 2
    cli = [
        sys.executable,
        "-m",
        "services.cli",
        "adapters",
        "promote",
        "race@7",
        "--nats",
        nats_server.url,
        "--expect-changes",
    ]
    refused = await asyncio.to_thread(
        subprocess.run, cli + [str(seen.alias.changes)], cwd=ROOT, capture_output=True, text=True
    )
    assert refused.returncode != 0 and "changed since you looked" in refused.stderr, refused.stdout + refused.stderr
    done = await asyncio.to_thread(subprocess.run, cli + [str(now)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("race: serves race@7"), done.stdout + done.stderr
    assert f"(change {now + 1}:" in done.stdout


async def test_a_corrupted_or_unservable_adapter_is_refused_on_every_node_with_the_reason(stack, nc, agents, tmp_path):
    agents.start("trainer", gpus="4096", hold_s=0.2)
    await wait_nodes(nc, 1)
    agents.start("a1", gpus=None, extra=engine(tmp_path, "a1"))
    agents.start("a2", gpus=None, extra=engine(tmp_path, "a2", "tiny", "--engine-max-rank", "8"))
    await wait_nodes(nc, 1)
    job = await trained(nc, lora={"r": 4}, register={"name": "broken"})
    obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    await obs.put(f"{job}/peft", b"not the adapter that was registered")  # the stored bytes no longer match
    await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="broken", version=1), AdapterReply)
    await serving(nc, "broken", {"a1": (1, "failed"), "a2": (1, "failed")})
    statuses = {n.node: n.message for n in (await show(nc, "broken")).nodes}
    assert all("sha256" in m for m in statuses.values()), statuses
    assert placed(tmp_path, "a1", "broken") is None

    wide = await trained(nc, lora={"r": 16}, register={"name": "wide", "promote": True})
    await serving(nc, "wide", {"a1": (1, "placed"), "a2": (1, "failed")})
    refusal = {n.node: n.message for n in (await show(nc, "wide")).nodes}["a2"]
    assert "rank 16 is above this engine's max LoRA rank 8" in refusal, (wide, refusal)
    assert "vLLM with a larger --max-lora-rank" in refusal and "--engine-max-rank" in refusal, refusal  # the fix


async def test_a_llama_cpp_engine_serves_one_name_and_a_retire_asks_for_its_restart(stack, nc, agents, tmp_path):
    """llama-server applies every adapter it was started with to every request: a second name for the same engine
    is refused, saying so; a retired one is removed and, with no restart command, the node says it needs one."""
    agents.start("trainer", gpus="4096", hold_s=0.2)
    await wait_nodes(nc, 1)
    agents.start("edge", gpus=None, extra=("--engine", f"llamacpp={tmp_path / 'gguf'}", "--engine-model", "tiny"))
    await trained(nc, served_by="llamacpp", register={"name": "capitals", "promote": True})
    await serving(nc, "capitals", {"edge": (1, "needs-restart")})
    assert (tmp_path / "gguf" / "capitals.gguf").is_file()

    await trained(nc, served_by="llamacpp", register={"name": "rivers", "promote": True})
    await serving(nc, "rivers", {"edge": (1, "failed")})
    [refused] = (await show(nc, "rivers")).nodes
    assert "serves capitals already" in refused.message and "another llama-server" in refused.message, refused.message
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == ["capitals.gguf"]  # rivers was never placed

    await bus.request(nc, names.ADAPTERS.retire, AliasRequest(name="capitals"), AdapterReply)
    # the state stays needs-restart across the retire: what tells the node's new report is its message
    await serving(nc, "capitals", {"edge": (1, "needs-restart")}, saying="removed")
    [retired] = (await show(nc, "capitals")).nodes
    assert "removed" in retired.message and "serves it until restarted" in retired.message, retired.message
    assert not (tmp_path / "gguf" / "capitals.gguf").exists()
    await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="rivers", version=1), AdapterReply)
    await serving(nc, "rivers", {"edge": (1, "needs-restart")})  # the engine is free for it now


async def test_a_canary_moves_a_few_nodes_first_and_the_registry_finishes_or_rolls_it_back(stack, nc):
    """The registry decides each canary from what its nodes report (written here as the nodes' agents write them,
    and the nodes' heartbeats sent as theirs): all verified -> every node; a mismatch on one -> rolled back with
    the reason; silence past the deadline -> the same. Without a verified node there is nothing to try a canary
    beside."""
    async with beating(nc, "n1", "n2", "n3"):
        await canaries(stack, nc)


async def canaries(stack, nc) -> None:
    from schemas.registry import NodeAdapterStatus

    registry = AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))
    draft = AdapterVersion(
        name="canaried",
        version=1,
        job="j",
        base_model="tiny",
        peft=StoredFile(name="j/peft", sha256="0" * 64, size=1),
        r=8,
        alpha=16,
        target_modules=["q_proj"],
    )
    for _ in range(3):
        await registry.add_version(draft)

    async def report(version: int, state: str, *nodes: str) -> None:
        for node in nodes:
            await registry.put_node_status(
                NodeAdapterStatus(
                    name="canaried",
                    version=version,
                    node=node,
                    engine="vllm http://x",
                    state=state,
                    message=f"{state} here",
                    updated=time.time(),
                )
            )

    async def promote(version: int, **more):
        return await bus.request(
            nc, names.ADAPTERS.promote, PromoteRequest(name="canaried", version=version, **more), AdapterReply | Error
        )

    async def alias():
        return (await show(nc, "canaried")).alias

    await promote(1)
    refused = await promote(2, canary="1")
    assert isinstance(refused, Error) and refused.field == "canary" and "no node serves" in refused.error, refused
    await report(1, "loaded", "n1", "n2", "n3")
    await wait_for(lambda: all_heard(promote), what="the registry to hear the three nodes")

    started = await promote(2, canary="1")  # n1 first
    assert started.alias.canary.nodes == ["n1"] and started.alias.current == 1
    assert started.alias.serving("n1") == 2 and started.alias.serving("n2") == 1
    await report(2, "loading", "n1")
    await report(2, "loaded", "n1")
    await wait_for(lambda: alias_is(alias, current=2, canary=None), timeout=20, what="the canary to finish")
    assert "passed on n1" in (await alias()).last_rollout and (await alias()).history == [1]

    await report(2, "loaded", "n2", "n3")
    trial = await promote(3, canary="34%")  # ceil(3 x 34%) = 2 nodes
    assert trial.alias.canary.nodes == ["n1", "n2"]
    await report(3, "loaded", "n1")
    await report(3, "mismatch", "n2")
    await wait_for(lambda: alias_is(alias, current=2, canary=None), timeout=20, what="the canary to roll back")
    assert "node n2 reported mismatch: mismatch here" in (await alias()).last_rollout
    await report(2, "loaded", "n1", "n2")  # their agents go back to @2

    await promote(3, canary="1")  # n1's @3 `loaded` from the canary before does not count for this one
    from services.registry.canary import outcome

    now = await show(nc, "canaried")
    assert now.alias.canary is not None and outcome(now.alias, now.nodes, time.time()) is None

    await promote(1)  # a plain promote ends a canary under way
    assert (await alias()).canary is None
    await report(1, "loaded", "n1", "n2", "n3")
    await promote(3, canary="1", canary_deadline_s=1.0)
    await wait_for(lambda: alias_is(alias, current=1, canary=None), timeout=20, what="the deadline to roll it back")
    last = (await alias()).last_rollout
    assert "not verified within 1s" in last and "n1 loaded" not in last, last


async def all_heard(promote) -> bool:
    """Whether a canary of all three nodes is refused as all of them (not as some not live)."""
    return "of the 3 nodes serving canaried is all of them" in (await promote(2, canary="3")).error


async def alias_is(alias, **want) -> bool:
    a = await alias()
    return all(getattr(a, k) == v for k, v in want.items())
