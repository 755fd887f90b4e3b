"""What the fleet serves has a life, end to end (real nats-server, agents as processes, engines a small real server
speaking vLLM's LoRA API): retention keeps the artifacts registered versions are made of; an engine keeps at most
its cap of adapters, the least recently used unloaded and reported so; a canary picks live nodes and counts a
report only under its own node's key, stored after the canary began; the statuses of a node that left go."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import tarfile
import time

import aiohttp
import msgspec
import pytest
from nats.js.api import ObjectMeta
from nats.js.errors import KeyNotFoundError

from schemas import names, nats_subjects
from schemas.artifacts import ArtifactMeta
from schemas.jobs import Error
from schemas.job_status import JobQuery, JobReply
from schemas.registry import AdapterReply, AdapterVersion, AliasRequest, NodeAdapterStatus, PromoteRequest, StoredFile
from services import bus
from schemas.object_headers import artifact_headers
from services.registry.canary import outcome
from services.registry.store import AdapterRegistry
from tests.conftest import beating, object_names, wait_for
from tests.lora_engine import LoraEngine
from tests.test_history import cancel, lead, queued
from tests.test_registry import serving, show


async def stored(nc, job: str, kind: str, data: bytes) -> StoredFile:
    """An artifact of `job` in the object store, as the artifact service stores one."""
    obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    name = names.artifact_name(job, kind)
    await obs.put(name, data, meta=ObjectMeta(name=name, headers=artifact_headers(job, kind, ArtifactMeta())))
    return StoredFile(name=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def peft_archive(label: str) -> bytes:
    """A PEFT adapter directory as a job stores it (tar.gz); `label` makes each one's bytes its own."""
    config = json.dumps({"r": 8, "lora_alpha": 16, "base_model_name_or_path": "x", "label": label}).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        member = tarfile.TarInfo("adapter_config.json")
        member.size = len(config)
        tar.addfile(member, io.BytesIO(config))
    return out.getvalue()


async def registered(nc, name: str, job: str, peft: StoredFile) -> int:
    """A version of `name` made of `job`'s adapter, written as the registry writes one."""
    registry = AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))
    draft = AdapterVersion(
        name=name, version=1, job=job, base_model="tiny", peft=peft, r=8, alpha=16, target_modules=["q_proj"]
    )
    return (await registry.add_version(draft)).version


async def promote(nc, name: str, version: int, **more) -> AdapterReply | Error:
    request = PromoteRequest(name=name, version=version, **more)
    return await bus.request(nc, names.ADAPTERS.promote, request, AdapterReply | Error)


# --- 7: retention keeps what the registry references ------------------------------------------------
async def test_retention_keeps_the_artifacts_of_a_served_version(nc, services):
    from services.artifacts.service import ArtifactService
    from services.registry.service import RegistryService

    await services.start(lambda c: ArtifactService(c))
    await services.start(lambda c: RegistryService(c))
    await lead(services, finished_in_memory_s=0.0, retention_s=1.0, sweep_interval_s=0.2, retention_artifacts=True)
    served, plain = await queued(nc, node="elsewhere"), await queued(nc, node="elsewhere")
    for job in (served, plain):
        await stored(nc, job, "checkpoint", b"optimizer state")
    peft = await stored(nc, served, "peft", peft_archive("served"))
    await stored(nc, plain, "peft", peft_archive("plain"))
    version = await registered(nc, "support", served, peft)
    assert isinstance(await promote(nc, "support", version), AdapterReply)
    for job in (served, plain):
        await cancel(nc, job)  # finished: expired a second later

    async def gone(job: str) -> bool:
        reply = await bus.request(nc, names.GET_JOB, JobQuery(job), JobReply | Error)
        return isinstance(reply, Error) and "no job" in reply.error

    await wait_for(lambda: all_of(gone(served), gone(plain)), timeout=20, what="both expired jobs to be removed")
    # the served version's adapter stays; what no version is made of (its checkpoint, the other job's) goes
    assert await object_names(nc) == [peft.name]
    assert (await show(nc, "support")).alias.current == version


async def all_of(*checks) -> bool:
    return all(await asyncio.gather(*checks))


# --- 8: an engine keeps at most its cap of adapters ------------------------------------------------
async def test_an_engine_over_its_cap_unloads_the_least_recently_used_and_says_so(stack, nc, agents):
    engine = await LoraEngine().start()
    try:
        agents.start(
            "api",
            gpus=None,
            extra=(
                "--engine", f"vllm={engine.url}", "--engine-model", "tiny", "--engine-max-adapters", "2",
                "--engine-check-interval", "0.5", "--adapter-cache-mib", "0",
            ),
        )  # fmt: skip
        files = {}
        for name in ("a", "b", "c"):
            files[name] = await stored(nc, f"job-{name}", "peft", peft_archive(name))
            await registered(nc, name, f"job-{name}", files[name])
        for name in ("a", "b"):
            await promote(nc, name, 1)
            await serving(nc, name, {"api": (1, "loaded")})
        engine.running = {"a"}  # a request under `a` runs (the engine steps with it): `b` is the least recently used
        engine.step(set())
        await promote(nc, "c", 1)
        await serving(nc, "c", {"api": (1, "loaded")})
        await serving(nc, "b", {"api": (1, "unloaded")})
        [b] = (await show(nc, "b")).nodes
        assert "cap of 2 adapters" in b.message and "least recently used" in b.message, b.message
        assert set(engine.adapters) == {"a", "c"} and engine.unloads == ["b"]
        assert [(n.node, n.state) for n in (await show(nc, "a")).nodes] == [("api", "loaded")]
        cache = agents.tmp / "api" / "adapters"  # its budget 0 keeps only what the engine serves
        await wait_for(lambda: not (cache / files["b"].sha256).exists(), timeout=20, what="b's files to go")

        engine.running = set()
        await bus.request(nc, names.ADAPTERS.retire, AliasRequest(name="c"), AdapterReply)  # room for b again
        await serving(nc, "c", {"api": (1, "unloaded")})
        await serving(nc, "b", {"api": (1, "loaded")})
        assert set(engine.adapters) == {"a", "b"}
    finally:
        await engine.stop()


async def test_the_resolvers_adapter_over_the_cap_stays_placed_and_loads_on_demand(stack, nc, agents, tmp_path):
    engine = await LoraEngine(resolver_dir=tmp_path / "loras").start()
    try:
        agents.start(
            "dir",
            gpus=None,
            extra=(
                "--engine", f"vllm-dir={engine.resolver_dir},{engine.url}", "--engine-model", "tiny",
                "--engine-max-adapters", "1", "--engine-check-interval", "0.5",
            ),
        )  # fmt: skip
        for name in ("a", "b"):
            await registered(nc, name, f"job-{name}", await stored(nc, f"job-{name}", "peft", peft_archive(name)))
            await promote(nc, name, 1)
            await serving(nc, name, {"dir": (1, "loaded")})
        await serving(nc, "a", {"dir": (1, "on-demand")})
        [a] = (await show(nc, "a")).nodes
        assert "loads it again at its next request" in a.message and "cap of 1 adapter " in a.message, a.message
        assert set(engine.adapters) == {"b"} and (engine.resolver_dir / "a" / "adapter_config.json").is_file()

        assert await complete(engine, "a") == 200  # vLLM resolves `a` again: now `b` is the least recently used
        await serving(nc, "b", {"dir": (1, "on-demand")})
        await wait_for(lambda: set(engine.adapters) == {"a"}, timeout=20, what="b unloaded, a kept")
        assert (engine.resolver_dir / "b" / "adapter_config.json").is_file()
    finally:
        await engine.stop()


async def complete(engine: LoraEngine, name: str) -> int:
    """A client's request under `name`: the status it gets."""
    async with aiohttp.ClientSession() as session:
        body = {"model": name, "prompt": "Hello", "max_tokens": 8}
        async with session.post(f"{engine.url}/v1/completions", json=body) as r:
            return r.status


# --- 9: canaries on live nodes, one clock, the key's node; departed nodes' statuses go -------------------
@pytest.fixture
async def registry(nc, services):
    """The registry service alone, forgetting a node a second after it was last heard (swept every 0.2 s)."""
    from services.registry.service import RegistryService

    service, *_ = await services.start(lambda c: RegistryService(c, departed_s=1.0, sweep_s=0.2))
    await asyncio.wait_for(service.ready.wait(), 10)
    return AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))


async def report(
    registry: AdapterRegistry, name: str, version: int, state: str, node: str, key: str | None = None, **more
) -> None:
    """A status of `node` as its agent writes it (under `key`'s key, if given: another node's)."""
    status = NodeAdapterStatus(name=name, version=version, node=node, engine="vllm http://x", state=state, **more)
    await registry.kv.put(names.adapter_node_key(name, key or node), msgspec.json.encode(status))


async def test_a_canary_picks_live_nodes_and_counts_only_the_keys_node_by_the_registrys_clock(nc, registry):
    file = StoredFile(name="j/peft", sha256="0" * 64, size=1)
    for _ in range(3):
        await registered(nc, "cap", "j", file)
    await promote(nc, "cap", 2)
    for node in ("n1", "n2", "n3"):
        await report(registry, "cap", 2, "loaded", node, updated=time.time())
    async with beating(nc, "n2", "n3"):  # n1 served it, and left: it sends no heartbeats

        async def picked():
            reply = await promote(nc, "cap", 3, canary="1")
            return reply if isinstance(reply, AdapterReply) else None

        trial = await wait_for(picked, what="the registry to hear n2 and n3")
        assert trial.alias.canary.nodes == ["n2"], trial.alias

        # not n2's word: a report for n2 under n9's key, and one for n9 under n2's key
        await report(registry, "cap", 3, "loaded", "n2", key="n9")
        await report(registry, "cap", 3, "mismatch", "n9", key="n2", message="forged")
        now = await show(nc, "cap")
        assert "n9" not in {n.node for n in now.nodes} and "forged" not in str(now.nodes), now.nodes
        assert now.alias.canary is not None and outcome(now.alias, now.nodes, time.time()) is None

        # n2's own report, stamped by a clock an hour behind the registry's: stored after the canary began, it counts
        await report(registry, "cap", 3, "loaded", "n2", updated=time.time() - 3600)
        await wait_for(lambda: canary_done(nc, "cap"), timeout=20, what="the canary to finish")
    alias = (await show(nc, "cap")).alias
    assert alias.current == 3 and "passed on n2" in alias.last_rollout, alias


async def canary_done(nc, name: str) -> bool:
    return (await show(nc, name)).alias.canary is None


async def test_the_statuses_of_a_node_that_left_go(nc, registry):
    async with beating(nc, "stays"):
        async with beating(nc, "leaves"):
            for name in ("a", "b"):
                await registered(nc, name, "j", StoredFile(name="j/peft", sha256="0" * 64, size=1))
                await report(registry, name, 1, "loaded", "leaves")
            await report(registry, "a", 1, "loaded", "stays")
        want = {"a": ["stays"], "b": []}
        await wait_for(lambda: nodes_of(nc, want), timeout=20, what="the statuses of the node that left to go")
        with pytest.raises(KeyNotFoundError):
            await registry.kv.get(names.adapter_node_key("b", "leaves"))
        await report(registry, "a", 1, "loaded", "stays")  # the bucket moves on: the purge markers may go too
        subject = nats_subjects.kv(names.ADAPTERS_KV).prefix + names.adapter_node_key("*", "leaves")
        await wait_for(lambda: no_messages_on(nc, subject), timeout=20, what="its purge markers to go")
        assert [n.node for n in (await show(nc, "a")).nodes] == ["stays"]


async def nodes_of(nc, want: dict[str, list[str]]) -> bool:
    return {a: [n.node for n in (await show(nc, a)).nodes] for a in want} == want


async def no_messages_on(nc, subject: str) -> bool:
    """Whether the registry's bucket holds no message on `subject` any more."""
    info = await nc.jetstream().stream_info(nats_subjects.kv(names.ADAPTERS_KV).stream, subjects_filter=subject)
    return not sum((info.state.subjects or {}).values())
