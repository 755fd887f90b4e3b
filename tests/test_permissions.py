"""The deploy permissions on a real nats-server: each role can do its work and nothing more."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import get_args

import msgspec
import nats
import pytest

from schemas import names, nats_subjects
from schemas.jobs import Accepted
from schemas.job_status import ActiveState, JobQuery, JobReply
from schemas.tenants import TenantRecord, tenant_key
from services.cli.permissions import authorization_block, env_var, roles
from services import bus
from services.artifacts.service import ArtifactService
from services.embedded import EmbeddedNats, free_port
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import HOLD_TRAINER, ROOT, retrying, submit, wait_for, wait_state
from tests.test_dashboard import CHROMIUM, FLAGS, needs_browser
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


@pytest.fixture
async def secured_page(tmp_path):
    """The deploy permissions, and a websocket listener whose connections are the dashboard user's
    (`no_auth_user`): the dashboard's page connects so, sending no password. Yields the server and its ws URL."""
    env = {env_var(u): password(u) for u in roles(NODES, TENANTS)}
    ws_port = free_port()
    listener = f"websocket {{ host: 127.0.0.1, port: {ws_port}, no_tls: true, no_auth_user: dashboard }}\n"
    server = EmbeddedNats(
        store_dir=tmp_path / "nats",
        websocket=False,
        extra_config=authorization_block(NODES, TENANTS) + listener,
        env=env,
    ).start()
    yield server, f"ws://127.0.0.1:{ws_port}"
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
            inbox_prefix=inbox or nats_subjects.inbox(user),
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
    await submitter.nc.publish(
        nats_subjects.objects(names.ARTIFACTS_BUCKET).meta("x/peft"), b"{}"
    )  # writing the object store
    await submitter.nc.flush()
    await wait_for(lambda: bool(submitter.violations), what="the server to refuse the write")
    info = await sched.nc.jetstream().stream_info(nats_subjects.objects(names.ARTIFACTS_BUCKET).stream)
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
    await acme.nc.publish(f"{nats_subjects.kv(names.TENANTS_KV).prefix}tenant.acme", b"{}")  # its own quota: an admin's
    await acme.nc.flush()
    await wait_for(lambda: len(acme.violations) >= 4, what="the server to refuse all four")
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
    quotas = await op.nc.jetstream().key_value(names.TENANTS_KV)  # `jetlora tenants set acme --weight 2`, as it
    await quotas.put(tenant_key("acme"), msgspec.json.encode(TenantRecord(weight=2)))
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
        await wait_for(lambda: "acme" in sched.cfg.quotas, what="the scheduler to follow the operator's quota")
        assert sched.cfg.quotas["acme"].weight == 2 and op.violations == [] and sched_c.violations == []
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


def agent_process(url: str, node: str, tmp_path, hold_s: float, steps: int) -> subprocess.Popen:
    """`jetlora agent` as the node's user, with one simulated device and the stand-in trainer."""
    secret = tmp_path / f"pw-{node}"
    secret.write_text(password(f"agent-{node}"))
    bus_flags = ["--nats", url, "--user", f"agent-{node}", "--password-file", str(secret)]
    agent = [
        "--node",
        node,
        "--simulate-gpus",
        "4096",
        "--heartbeat-interval",
        "0.25",
        "--work-dir",
        str(tmp_path / node),
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "agent", *bus_flags, *agent, "--trainer-command", HOLD_TRAINER],
        cwd=ROOT,
        env={**os.environ, "HOLD_S": str(hold_s), "HOLD_STEPS": str(steps), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / f"agent-{node}.log", "w"),
    )


@needs_browser
async def test_the_dashboard_page_reads_what_it_shows_under_the_deploy_permissions(secured_page, tmp_path):
    """The page in Chromium, over websocket as the dashboard user, and the dashboard server as it too, beside the
    services under their own users: the job list, the tenants' shares, a job's events replayed and followed (nats.js
    pulls them: `$JS.API.CONSUMER.MSG.NEXT.JETLORA_JOBS.<its consumer>`), the rewards' consumer, the registry and
    eval runs, the Tinker sessions: the server refuses it nothing and the page says nothing is wrong. It may still not
    pull from the scheduler's own consumer, nor another stream's."""
    from playwright.async_api import async_playwright

    from services.dashboard.server import Dashboard
    from services.evals.service import EvalsService
    from services.registry.service import RegistryService

    server, ws_url = secured_page
    users = ("scheduler", "artifacts", "dashboard", "tenant-acme")
    sched_c, arts_c, dash_c, acme = [await as_user(server.url, u) for u in users]
    await bus.ensure_resources(sched_c.nc)
    stop = asyncio.Event()
    sched = Scheduler(sched_c.nc, SchedulerConfig(co_train="off", heartbeat_interval=0.25))
    evals, dash = EvalsService(sched_c.nc), Dashboard(dash_c.nc, ws_url, port=0)
    parts = (sched.run(stop), RegistryService(sched_c.nc).run(stop), evals.run(stop), dash.run(stop))
    tasks = [asyncio.create_task(p) for p in (*parts, ArtifactService(arts_c.nc).run(stop))]
    agent = None
    try:
        for ready in (sched.leading, evals.ready, dash.ready):
            await asyncio.wait_for(ready.wait(), 15)
        agent = agent_process(server.url, "n1", tmp_path, hold_s=60, steps=60)  # a step a second
        reply = await bus.request(acme.nc, names.jobs_api("acme").submit, {**HELD, "label": "watched"}, Accepted)
        job = reply.job
        await wait_for(lambda: stepped(acme.nc, "acme", job), timeout=30, what=f"job {job} under way")
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = await browser.new_page()
            await page.goto(f"http://127.0.0.1:{dash.port}/?job={job}")
            # replayed from its first step and followed: the page's pull consumer of the JOBS stream
            await until(page, "window.jetlora.points.length >= 2", "the job's events replayed")
            first = await page.evaluate("window.jetlora.points.length")
            await until(page, f"window.jetlora.points.length > {first}", "the job's events followed")
            checks = [
                f"{page_text('#jobs')}.includes({job!r})",
                f"{page_text('#tenants')}.includes('acme') && {page_text('#tenants')}.includes('1 of 1')",
                f"{page_text('#nodes')}.includes('n1')",
                f"{page_text('#adapters')}.includes('none registered')",
                f"{page_text('#runs')}.includes('no eval runs')",
                f"{page_text('#sessions')}.includes('no Tinker sessions')",
                f"{page_text('#status')}.startsWith('connected') && !{page_text('#status')}.includes('·')",
            ]
            await until(page, " && ".join(checks), "every panel, and nothing wrong")
            await browser.close()
        refused = [line for line in server_log(server) if "Violation" in line]
        assert refused == [] and dash_c.violations == [], (refused, dash_c.violations)
        # still refused: the scheduler's own consumer, and any other stream's consumers
        scheduler_consumer = nats_subjects.js_api(
            "CONSUMER", "MSG", "NEXT", names.JOBS_STREAM, names.SCHEDULER_CONSUMER
        )
        others = nats_subjects.js_api("CONSUMER", "MSG", "NEXT", nats_subjects.kv(names.JOBS_KV).stream, "x")
        for subject in (scheduler_consumer, others):
            await dash_c.nc.publish(subject, b"{}", reply=dash_c.nc.new_inbox())
        await dash_c.nc.flush()
        await wait_for(lambda: len(dash_c.violations) >= 2, what="the server to refuse both pulls")
        told = " ".join(dash_c.violations).lower()  # nats-py lowercases the server's -ERR
        assert scheduler_consumer.lower() in told and others.lower() in told, dash_c.violations
    finally:
        if agent is not None:
            agent.kill()
            agent.wait()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in (sched_c, arts_c, dash_c, acme):
            await c.nc.close()


HELD = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2)}  # for the stand-in trainer


async def stepped(nc, tenant: str, job: str) -> bool:
    """Whether the tenant's job made its first steps (asked as the tenant)."""
    reply = await bus.request(nc, names.jobs_api(tenant).job, JobQuery(job), JobReply)
    assert reply.job.state in ("queued", *get_args(ActiveState), "succeeded"), reply.job  # on its way, or done
    return reply.job.step >= 2


async def until(page, condition: str, what: str, timeout: float = 30) -> None:
    """Until the page's `condition` holds; else the test fails with what the page's status line says."""
    try:
        await page.wait_for_function(condition, timeout=timeout * 1000)
    except Exception:
        status = await page.text_content("#status")
        raise AssertionError(f"the page never showed {what}; its status line: {status!r}") from None


def page_text(selector: str) -> str:
    return f"(document.querySelector({selector!r}) || {{textContent: ''}}).textContent"


def server_log(server: EmbeddedNats) -> list[str]:
    return (server.store_dir / "nats-server.log").read_text(errors="replace").splitlines()
