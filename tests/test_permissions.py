"""The deploy permissions on a real nats-server: each role can do its work and nothing more."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import msgspec
import nats
import pytest

from schemas import names
from schemas.jobs import Accepted
from services.cli.permissions import authorization_block, env_var, roles
from services import bus
from services.artifacts.service import ArtifactService
from services.embedded import EmbeddedNats
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import HOLD_TRAINER, ROOT, retrying, submit, wait_for, wait_state
from tests.qa import pairs

NODES = ["n1", "n2"]
TENANTS = ["acme", "globex"]


def password(user: str) -> str:
    return f"pw-{user}"


@pytest.fixture
async def secured(tmp_path):
    env = {env_var(u): password(u) for u in roles(NODES, TENANTS)}
    server = EmbeddedNats(
        store_dir=tmp_path / "nats", extra_config=authorization_block(NODES, TENANTS), env=env
    ).start()
    yield server
    server.stop()


class Client:
    """A connection as one role that records the permission violations the server reports."""

    def __init__(self):
        self.violations: list[str] = []
        self.nc = None

    async def connect(self, url: str, user: str, inbox: str | None = None):
        async def on_error(e):
            if "permissions violation" in str(e).lower():
                self.violations.append(str(e))

        self.nc = await nats.connect(
            url,
            user=user,
            password=password(user),
            error_cb=on_error,
            max_reconnect_attempts=1,
            inbox_prefix=inbox or names.inbox(user),
        )
        return self


async def as_user(url, user) -> Client:
    return await Client().connect(url, user)


async def test_each_role_does_its_work_under_the_deploy_permissions(secured, tmp_path):
    sched_c, arts_c, sub_c = [await as_user(secured.url, u) for u in ("scheduler", "artifacts", "submitter")]
    await bus.ensure_resources(sched_c.nc)
    stop = asyncio.Event()
    sched = Scheduler(sched_c.nc, SchedulerConfig(co_train="off", heartbeat_interval=0.25))
    tasks = [asyncio.create_task(sched.run(stop)), asyncio.create_task(ArtifactService(arts_c.nc).run(stop))]
    (tmp_path / "pw").write_text(password("agent-n1"))
    agent_pw = ["--user", "agent-n1", "--password-file", str(tmp_path / "pw")]
    agent = None
    try:
        await asyncio.wait_for(sched.leading.wait(), 10)
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "agent",
                "--nats",
                secured.url,
                "--node",
                "n1",
                "--simulate-gpus",
                "4096",
                "--heartbeat-interval",
                "0.25",
                "--work-dir",
                str(tmp_path / "n1"),
                "--trainer-command",
                HOLD_TRAINER,
                *agent_pw,
            ],
            cwd=ROOT,
            env={**os.environ, "HOLD_S": "0.3", "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "agent.log", "w"),
        )
        reply = await submit(sub_c.nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2)})
        assert isinstance(reply, Accepted)
        job = await wait_state(sub_c.nc, reply.job, ("succeeded", "failed"), timeout=30)
        assert job.state == "succeeded", (job.message, (tmp_path / "agent.log").read_text()[-2000:])
        assert [a.kind for a in job.artifacts] == ["peft"]
        agent.terminate()
        assert agent.wait(10) == 0
    finally:
        if agent and agent.poll() is None:
            agent.kill()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in (sched_c, arts_c, sub_c):
            await c.nc.close()


async def test_what_each_role_must_not_do(secured):
    sched = await as_user(secured.url, "scheduler")
    await bus.ensure_resources(sched.nc)
    heard = []

    async def record(msg):
        heard.append(msg)

    await sched.nc.subscribe(names.node("n2").heartbeat, cb=record)
    await sched.nc.flush()

    agent = await as_user(secured.url, "agent-n1")
    await agent.nc.publish(names.node("n2").heartbeat, b"{}")  # pretending to be another node
    await agent.nc.subscribe(names.node("n2").assign)  # reading another node's assignments
    await agent.nc.publish(
        names.job("somejob", "n2", names.ADMIN_TENANT).state, b"{}"
    )  # speaking for another node's job
    with pytest.raises(Exception):
        await agent.nc.request(names.ARTIFACTS_DELETE, b'{"job": "x"}', timeout=1)
    await agent.nc.flush()
    await wait_for(lambda: len(agent.violations) >= 3, what="the server to refuse all three")
    await sched.nc.flush()
    assert heard == []

    submitter = await as_user(secured.url, "submitter")
    await submitter.nc.publish(names.objects(names.ARTIFACTS_BUCKET).meta("x/peft"), b"{}")  # writing the object store
    await submitter.nc.flush()
    await wait_for(lambda: bool(submitter.violations), what="the server to refuse the write")
    info = await sched.nc.jetstream().stream_info(names.objects(names.ARTIFACTS_BUCKET).stream)
    assert info.state.messages == 0

    dashboard = await as_user(secured.url, "dashboard")
    with pytest.raises(Exception):
        await dashboard.nc.request(names.SUBMIT, b"{}", timeout=1)
    await wait_for(lambda: bool(dashboard.violations), what="the server to refuse the submit")
    acme = await as_user(secured.url, "tenant-acme")
    with pytest.raises(nats.errors.NoRespondersError):  # allowed (no scheduler runs here to answer it)
        await acme.nc.request(names.jobs_api("acme").submit, b"{}", timeout=1)
    for foreign in (names.jobs_api("globex").jobs, names.LIST_JOBS, names.SUBMIT):  # another's, the admin's
        await acme.nc.publish(foreign, b"{}")
    await acme.nc.flush()
    await wait_for(lambda: len(acme.violations) >= 3, what="the server to refuse all three")
    for c in (sched, agent, submitter, dashboard, acme):
        await c.nc.close()


async def test_the_gateway_works_as_its_keys_tenants_under_the_deploy_permissions(secured, tmp_path):
    import openai

    from services.gateway.app import Gateway
    from services.gateway.keys import KeyStore, new_key
    from services.gateway.openai_map import BaseModel
    from services.registry.service import RegistryService

    sched_c, arts_c, op, gw = [await as_user(secured.url, u) for u in ("scheduler", "artifacts", "operator", "gateway")]
    await bus.ensure_resources(sched_c.nc)
    stop = asyncio.Event()
    sched = Scheduler(sched_c.nc, SchedulerConfig(co_train="off", heartbeat_interval=0.25))
    tasks = [asyncio.create_task(sched.run(stop)), asyncio.create_task(ArtifactService(arts_c.nc).run(stop))]
    tasks.append(asyncio.create_task(RegistryService(sched_c.nc).run(stop)))  # beside the scheduler, as it runs
    key, record = new_key("acme")
    await (await KeyStore.open(op.nc.jetstream())).put(record)  # `jetlora keys create`, as the operator
    gateway = Gateway(gw.nc, {"tiny": BaseModel("tiny", "/models/tiny")}, port=0)
    try:
        await asyncio.wait_for(sched.leading.wait(), 10)
        await gateway.start()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=key, max_retries=0)
        (tmp_path / "d.jsonl").write_text('{"q": "What is jetlora?", "a": "A LoRA trainer."}\n' * 3)
        with open(tmp_path / "d.jsonl", "rb") as f:
            file = await client.files.create(file=f, purpose="fine-tune")
        job = await client.fine_tuning.jobs.create(model="tiny", training_file=file.id)
        assert (await client.fine_tuning.jobs.retrieve(job.id)).status == "queued"
        assert [j.id for j in (await client.fine_tuning.jobs.list()).data] == [job.id]
        assert [e async for e in client.fine_tuning.jobs.list_events(job.id)] == []  # queued: none yet
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        with pytest.raises(openai.NotFoundError):
            await client.models.delete("ft-tiny-none")
        await gw.nc.request(names.ADAPTERS.retire, b"{}", timeout=5)  # what DELETE /v1/models/{id} asks
        assert gw.violations == []
        await gw.nc.publish(names.SUBMIT, b"{}")  # the gateway itself may not act as an admin
        await gw.nc.flush()
        await wait_for(lambda: bool(gw.violations), what="the server to refuse the admin's submit")
    finally:
        await gateway.close()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in (sched_c, arts_c, op, gw):
            await c.nc.close()


async def test_who_acts_for_tenants_cannot_publish_under_a_reserved_tenant_token(secured):
    """The gateway's `jetlora.api.*.<verb>` (and `jetlora.datasets.*.<verb>`) matched `_`, the admins' token, and
    `upload`: the deploy permissions deny both to it (and to tenants), while every tenant's verbs stay its."""
    gw, acme = await as_user(secured.url, "gateway"), await as_user(secured.url, "tenant-acme")
    with pytest.raises(nats.errors.NoRespondersError):  # allowed (no scheduler runs here to answer it)
        await gw.nc.request(names.jobs_api("acme").jobs, b"{}", timeout=1)
    reserved = [names.jobs_api(names.ADMIN_TENANT).jobs, names.jobs_api(names.ADMIN_TENANT).submit]
    reserved += [names.jobs_api("upload").cancel, names.datasets_api(names.ADMIN_TENANT).list]
    reserved += [names.datasets_api("upload").delete, names.dataset_upload("x", names.ADMIN_TENANT)]
    for client in (gw, acme):
        for subject in reserved:
            before = len(client.violations)
            await client.nc.publish(subject, b"{}")
            await client.nc.flush()
            await wait_for(
                lambda c=client, n=before: len(c.violations) > n, timeout=10, what=f"the server to refuse {subject}"
            )
    assert all("jetlora.api.acme" not in v for v in gw.violations)
    for c in (gw, acme):
        await c.nc.close()


async def test_the_operator_and_a_monitor_discover_every_service_and_read_its_stats(secured):
    """$SRV.PING under the generated permissions: the scheduler's process answers for the scheduler and the
    registry (two replies to one request from one user), the artifact service for itself."""
    from services.registry.service import RegistryService

    sched_c, arts_c = [await as_user(secured.url, u) for u in ("scheduler", "artifacts")]
    await bus.ensure_resources(sched_c.nc)
    stop = asyncio.Event()
    sched = Scheduler(sched_c.nc, SchedulerConfig(co_train="off", heartbeat_interval=0.25))
    parts = (sched.run(stop), RegistryService(sched_c.nc).run(stop), ArtifactService(arts_c.nc).run(stop))
    tasks = [asyncio.create_task(p) for p in parts]
    wanted = {names.SCHEDULER_SERVICE, names.ADAPTER_SERVICE, names.ARTIFACT_SERVICE}
    try:
        await asyncio.wait_for(sched.leading.wait(), 10)
        for user in ("operator", "monitor"):
            asker = await as_user(secured.url, user)
            heard: dict[str, dict] = {}
            inbox = asker.nc.new_inbox()

            async def on_reply(msg, heard=heard):
                reply = msgspec.json.decode(msg.data)
                heard[reply["name"]] = reply

            sub = await asker.nc.subscribe(inbox, cb=on_reply)
            try:
                await wait_for(
                    lambda asker=asker, inbox=inbox, heard=heard: _ping(asker.nc, inbox, heard, wanted),
                    timeout=20,
                    interval=0.3,
                    what=f"every service to answer {user}'s $SRV.PING",
                )
                for name in wanted:
                    stats = await asker.nc.request(f"$SRV.STATS.{name}", b"", timeout=5)
                    assert msgspec.json.decode(stats.data)["name"] == name
            finally:
                await sub.unsubscribe()
                await asker.nc.close()
            assert not asker.violations, (user, asker.violations)
        assert not sched_c.violations and not arts_c.violations, (sched_c.violations, arts_c.violations)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in (sched_c, arts_c):
            await c.nc.close()


async def _ping(nc, inbox: str, heard: dict, wanted: set[str]) -> bool:
    await nc.publish("$SRV.PING", b"", reply=inbox)
    await nc.flush()
    return wanted <= set(heard)


async def test_an_engine_eval_run_asks_its_node_and_stores_its_results_under_the_deploy_permissions(secured):
    """The evals service (in the scheduler's process, as its user) asks a node's agent on that node's evaluate
    subject, and stores and deletes the run's results in the artifacts bucket; an agent hears only its own node's."""
    from schemas.evals import EvalRun, EvalSummary
    from services.evals.engine_path import drop_results, store_results

    sched, agent = await as_user(secured.url, "scheduler"), await as_user(secured.url, "agent-n1")
    await bus.ensure_resources(sched.nc)

    async def answer(msg):
        await msg.respond(b'{"type": "engine_eval", "node": "n1", "engine": "e", "items": []}')

    await agent.nc.subscribe(names.node("n1").evaluate, cb=answer)
    await agent.nc.flush()
    reply = await retrying(  # the subscription may reach the server a moment after the flush under load
        lambda: sched.nc.request(names.node("n1").evaluate, b"{}", timeout=5), nats.errors.NoRespondersError
    )
    assert b"engine_eval" in reply.data
    run = EvalRun(id="evalrun_p", eval="e", job="", base_model="tiny", dataset="d")
    name, _ = await store_results(sched.nc.jetstream(), run, [], EvalSummary(items=0, samples=0, graders=[]))
    await drop_results(sched.nc.jetstream(), msgspec.structs.replace(run, results=name))
    await agent.nc.subscribe(names.node("n2").evaluate)  # another node's runs
    await agent.nc.flush()
    await wait_for(lambda: bool(agent.violations), what="the server to refuse the subscription")
    assert not sched.violations, sched.violations
    for c in (sched, agent):
        await c.nc.close()
