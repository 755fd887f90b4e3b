"""A 3-server JetStream cluster with 3 replicas of everything: kill the server leading the jobs' stream mid-job."""

from __future__ import annotations

import asyncio

import nats
import pytest

from schemas import names
from services import bus
from services.artifacts.service import ArtifactService
from services.embedded import EmbeddedNats, free_port
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import Agents, progress_steps, run_held_job, wait_state


@pytest.fixture
async def cluster(tmp_path):
    routes = [free_port() for _ in range(3)]
    servers = []
    for i in range(3):
        conf = (
            f"server_name: s{i}\ncluster {{ name: jl, host: 127.0.0.1, port: {routes[i]}, routes: ["
            + ", ".join(f'"nats-route://127.0.0.1:{p}"' for j, p in enumerate(routes) if j != i)
            + "] }\n"
        )
        servers.append(EmbeddedNats(store_dir=tmp_path / f"s{i}", websocket=False, extra_config=conf))
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        s.stop()


async def test_killing_the_stream_leader_mid_job_loses_nothing(cluster, tmp_path):
    url = ",".join(s.url for s in cluster)
    opts = dict(servers=url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    nc = await nats.connect(**opts)
    js = nc.jetstream()
    for _ in range(100):  # the cluster elects its meta leader first
        try:
            await bus.ensure_resources(nc, replicas=3)
            break
        except Exception:
            await asyncio.sleep(0.2)
    info = await js.stream_info(names.JOBS_STREAM)
    assert info.config.num_replicas == 3
    agents = Agents(url, tmp_path)
    started = []
    try:
        for factory in (
            lambda c: Scheduler(c, SchedulerConfig(co_train="off", heartbeat_interval=0.25, misses=8)),
            lambda c: ArtifactService(c),
        ):
            conn = await nats.connect(**opts)
            stop = asyncio.Event()
            svc = factory(conn)
            started.append((stop, asyncio.create_task(svc.run(stop)), conn))
            if isinstance(svc, Scheduler):
                await asyncio.wait_for(svc.leading.wait(), 20)
        job_id = await run_held_job(nc, agents, hold_s=5.0)
        leader = (await js.stream_info(names.JOBS_STREAM)).cluster.leader
        victim = next(s for i, s in enumerate(cluster) if f"s{i}" == leader)
        victim.kill()
        job = await wait_state(nc, job_id, ("succeeded", "failed"), timeout=90)
        assert job.state == "succeeded", (job.message, agents.log("n1")[-2000:])
        assert await progress_steps(nc, job_id) == list(range(1, 11))
        assert (await js.stream_info(names.JOBS_STREAM)).cluster.leader != leader
    finally:
        agents.close()
        for stop, task, conn in started:
            stop.set()
            await asyncio.wait_for(task, 15)
            await conn.close()
        await nc.close()
