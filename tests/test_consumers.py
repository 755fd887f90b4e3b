"""No request creates a JetStream consumer: thousands of registry, artifact, dataset and dashboard reads leave the
consumer count of every stream as it was; the rollout task rides out a registry it cannot follow yet."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats
import pytest

from schemas import names, nats_subjects
from schemas.artifacts import ArtifactList, ArtifactQuery
from schemas.datasets import DatasetList, DatasetListQuery
from schemas.events import EventPage, EventsQuery
from schemas.jobs import Accepted, Error
from schemas.job_status import JobList, JobListQuery
from schemas.nodes import NodeList
from schemas.registry import AdapterList, AdapterListQuery, AdapterQuery, AdapterReply, AdapterVersion, StoredFile
from services import bus
from services.artifacts.service import ArtifactService
from services.embedded import EmbeddedNats
from services.registry.service import RegistryService
from services.registry.store import AdapterRegistry
from services.scheduler.service import Scheduler
from tests.conftest import STACK_CONFIG, Agents, InProcess, answering, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs


@pytest.fixture
async def own_server(tmp_path):
    server = EmbeddedNats(store_dir=tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
async def own_stack(own_server):
    """A connection to a server of this test's own, with the scheduler, registry and artifact service on it."""
    nc = await nats.connect(own_server.url)
    await bus.ensure_resources(nc)
    services = InProcess(own_server.url)
    try:
        await start_stack(services)
        yield nc
    finally:
        await services.close()
        await nc.close()


async def consumers(js) -> dict[str, int]:
    return {s.config.name: s.state.consumer_count for s in await js.streams_info()}


async def start_stack(services: InProcess):
    sched, *_ = await services.start(lambda c: Scheduler(c, STACK_CONFIG))
    await services.start(lambda c: ArtifactService(c))
    await services.start(lambda c: RegistryService(c))
    await asyncio.wait_for(sched.leading.wait(), 10)


async def registered(nc, count: int) -> None:
    registry = AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))
    for i in range(count):
        await registry.add_version(
            AdapterVersion(
                name=f"a{i}",
                version=1,
                job=f"j{i}",
                base_model="tiny",
                r=8,
                alpha=16,
                peft=StoredFile(name=f"j{i}/peft", sha256="0" * 64, size=1),
                target_modules=["q_proj"],
            )
        )


async def test_two_thousand_reads_leave_every_streams_consumers_as_they_were(own_stack):
    nc = own_stack
    await registered(nc, 10)
    job = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)})
    assert isinstance(job, Accepted), job
    for subject in (names.ADAPTERS.list, names.ARTIFACTS_LIST, names.DATASETS.list):
        await answering(nc, subject)
    js = nc.jetstream()
    before = await consumers(js)

    async def reads(i: int) -> None:
        shown = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name=f"a{i % 10}"), AdapterReply)
        listed = await bus.request(nc, names.ADAPTERS.list, AdapterListQuery(), AdapterList)
        assert shown.alias.name == f"a{i % 10}" and len(listed.adapters) == 10

    for first in range(0, 1000, 25):  # 1,000 shows and 1,000 lists, 25 at a time
        await asyncio.gather(*(reads(i) for i in range(first, first + 25)))

    for _ in range(100):  # what an open dashboard polls, and the other list requests a client repeats
        await bus.request(nc, names.LIST_JOBS, JobListQuery(), JobList)
        await bus.request(nc, names.LIST_NODES, b"{}", NodeList)
        await bus.request(nc, names.ARTIFACTS_LIST, ArtifactQuery(), ArtifactList)
        await bus.request(nc, names.DATASETS.list, DatasetListQuery(), DatasetList)
        await bus.request(nc, names.EVENTS, EventsQuery(job=job.job), EventPage)
    after = await consumers(js)
    print(f"consumers per stream before and after 2,000 registry reads and 500 list requests: {after}")
    assert after == before, f"consumers before {before}, after {after}"
    assert before[nats_subjects.kv(names.ADAPTERS_KV).stream] == 1  # the registry's own view, and nothing per request


async def test_a_read_sees_a_change_made_just_before_it(own_stack):
    """The registry answers from its view, yet a version written directly to the bucket is in the next reply."""
    nc = own_stack
    await answering(nc, names.ADAPTERS.list)
    for count in range(1, 6):
        await registered(nc, count)  # a0 gains a version each round
        shown = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name="a0"), AdapterReply)
        assert [v.version for v in shown.versions] == list(range(1, count + 1))


async def test_the_rollout_follows_the_registry_once_it_can(own_server, tmp_path):
    """An agent with an engine that starts before the registry's bucket exists retries, then serves what is promoted."""
    agents = Agents(own_server.url, tmp_path)
    nc = await nats.connect(own_server.url)
    services = InProcess(own_server.url)
    try:
        agents.start("edge", gpus=None, extra=("--engine", f"vllm-dir={tmp_path / 'engine'}", "--engine-model", "tiny"))
        await wait_for(
            lambda: "following the adapter registry failed" in agents.log("edge"),
            timeout=30,
            what="the rollout to find no registry",
        )
        await bus.ensure_resources(nc)
        await start_stack(services)
        agents.start("trainer", gpus="4096", hold_s=0.2)
        await wait_nodes(nc, 2)
        reply = await submit(
            nc,
            {
                "model": "tiny",
                "base_dir": "/models/tiny",
                "data": pairs(1),
                "register": {"name": "support", "promote": True},
            },
        )
        assert isinstance(reply, Accepted), reply
        assert (await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=60)).state == "succeeded"
        t0 = time.monotonic()

        async def loaded() -> bool:  # registration follows the job's success: until then there is no "support"
            shown = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name="support"), AdapterReply | Error)
            return isinstance(shown, AdapterReply) and any(
                n.node == "edge" and n.state == "placed" for n in shown.nodes
            )

        await wait_for(loaded, timeout=60, what="the edge node to load support@1")
        print(f"edge loaded support@1 {time.monotonic() - t0:.1f}s after the job ended")
        assert msgspec.json.decode((tmp_path / "engine" / "support" / "adapter_config.json").read_bytes())["r"] == 1
    finally:
        agents.close()
        await services.close()
        await nc.close()
