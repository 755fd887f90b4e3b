"""The tenancy issue's attacks, tried with the credentials `jetlora permissions` generates (tenants acme and globex,
agents n1 and n2, the operator) on a real nats-server: each attempt is refused, and what it aimed at is unchanged.

Globex's job G runs on n2 and registers the adapter globex-support; acme and agent n1 then attack it."""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats
import pytest

from schemas import names, nats_subjects
from schemas.artifacts import ArtifactMeta, Chunk, ChunkAck
from schemas.datasets import DatasetUpload
from schemas.events import EventPage, EventsQuery, Progress, Samples, StateChange
from schemas.jobs import Accepted, Rejected, SubmitReply, Error
from schemas.job_status import JobReply, JobQuery
from schemas.registry import AdapterQuery, AdapterReply
from services import bus
from services.transfer.sender import upload_dataset
from services.artifacts.service import ArtifactService
from services.cli.watch import follow
from services.registry.service import RegistryService
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import Agents, wait_for
from tests.qa import pairs
from tests.test_permissions import NODES, TENANTS, as_user, password, secured  # noqa: F401 (a fixture)

JOB = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2)}
_ack = msgspec.json.Decoder(ChunkAck)


class Fleet:
    """The services as their deploy users, and agents n1 and n2 as processes with theirs."""

    def __init__(self, url: str, tmp_path) -> None:
        self.url, self.tmp = url, tmp_path
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.agents = Agents(url, tmp_path)

    async def start(self) -> None:
        self.sched_c, arts_c, reg_c = [await as_user(self.url, u) for u in ("scheduler", "artifacts", "scheduler")]
        await bus.ensure_resources(self.sched_c.nc)
        sched = Scheduler(self.sched_c.nc, SchedulerConfig(co_train="off", heartbeat_interval=0.25))
        self.tasks = [
            asyncio.create_task(s.run(self.stop))
            for s in (sched, ArtifactService(arts_c.nc), RegistryService(reg_c.nc))
        ]
        self.conns = [self.sched_c, arts_c, reg_c]
        await asyncio.wait_for(sched.leading.wait(), 10)
        for node in NODES:
            (self.tmp / f"pw-{node}").write_text(password(f"agent-{node}"))
            self.agents.start(
                node,
                gpus="4096",
                hold_s=0.3,
                bus_flags=("--user", f"agent-{node}", "--password-file", str(self.tmp / f"pw-{node}")),
            )

    async def user(self, name: str):
        client = await as_user(self.url, name)
        self.conns.append(client)
        return client

    async def close(self) -> None:
        self.agents.close()
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in self.conns:
            await c.nc.close()


@pytest.fixture
async def fleet(secured, tmp_path):  # noqa: F811
    f = Fleet(secured.url, tmp_path)
    await f.start()
    yield f
    await f.close()


async def submit_as(client, tenant: str, **job) -> SubmitReply:
    return await bus.request(client.nc, names.jobs_api(tenant).submit, {**JOB, **job}, SubmitReply, timeout=10)


async def job_as(client, tenant: str, job: str):
    return (await bus.request(client.nc, names.jobs_api(tenant).job, JobQuery(job), JobReply)).job


async def finished(client, tenant: str, job: str):
    await wait_for(lambda: _ended(client, tenant, job), timeout=60, what=f"job {job} to end")
    return await job_as(client, tenant, job)


async def _ended(client, tenant, job) -> bool:
    return (await job_as(client, tenant, job)).state in ("succeeded", "failed", "cancelled")


async def refused(client, before: int) -> None:
    await client.nc.flush()
    await wait_for(lambda: len(client.violations) > before, timeout=10, what="the server to refuse it")


async def test_no_tenant_or_node_can_read_replace_or_serve_what_is_anothers(fleet, tmp_path):
    acme, globex, n1, operator = [await fleet.user(u) for u in ("tenant-acme", "tenant-globex", "agent-n1", "operator")]

    # globex's job G, on n2, registers and promotes globex-support
    reply = await submit_as(
        globex, "globex", node="n2", label="globex's", register={"name": "globex-support", "promote": True}
    )
    assert isinstance(reply, Accepted), reply
    g = reply.job
    done = await finished(globex, "globex", g)
    assert done.state == "succeeded", done.message

    async def promoted():  # the scheduler asks the registry to register a job's adapter after it records the
        # success, so a reader can see the success first: until then the name is unknown (an Error)
        shown = await bus.request(
            operator.nc, names.ADAPTERS.show, AdapterQuery(name="globex-support"), AdapterReply | Error
        )
        return shown.alias if isinstance(shown, AdapterReply) and shown.alias.current == 1 else None

    alias = await wait_for(promoted, timeout=20, what="globex-support@1 to be promoted")
    assert alias.tenant == "globex"
    artifacts_before = [(a.name, a.sha256) for a in done.artifacts]

    # 1. replies: nobody reads another's inbox, nobody acks the scheduler's consumer
    for client in (acme, n1):
        before = len(client.violations)
        await client.nc.subscribe(nats_subjects.inbox(">"))  # every user's replies at once
        await refused(client, before)
        before = len(client.violations)
        await client.nc.subscribe(nats_subjects.inbox_all("tenant-globex"))
        await refused(client, before)
        before = len(client.violations)
        await client.nc.publish(f"$JS.ACK.{names.JOBS_STREAM}.{names.SCHEDULER_CONSUMER}.1.1.1.1.0", b"+ACK")
        await refused(client, before)
    before = len(operator.violations)  # even the operator may not delete the scheduler's consumer
    await operator.nc.publish(
        nats_subjects.js_api("CONSUMER", "DELETE", names.JOBS_STREAM, names.SCHEDULER_CONSUMER), b""
    )
    await refused(operator, before)

    # 2. acme cannot register under globex's adapter name: refused at submit, naming register.name
    taken = await submit_as(acme, "acme", register={"name": "globex-support", "promote": True})
    assert isinstance(taken, Rejected) and taken.errors[0].field == "register.name", taken
    alias_after = (
        await bus.request(operator.nc, names.ADAPTERS.show, AdapterQuery(name="globex-support"), AdapterReply)
    ).alias
    assert (alias_after.current, alias_after.latest, alias_after.tenant) == (1, 1, "globex")

    # 3. datasets: one an admin shared with globex is not there for acme (to train on, or as validation data)
    data = tmp_path / "private.jsonl"
    data.write_text("".join(json.dumps({"q": f"secret {i}?", "a": f"globex {i}"}) + "\n" for i in range(8)))
    stored = await upload_dataset(operator.nc, "globex-private", data, DatasetUpload(share=["globex"]))
    for field in ("dataset", "validation_dataset"):
        stolen = await submit_as(
            acme, "acme", **{field: {"name": "globex-private"}}, **({"data": []} if field == "dataset" else {})
        )
        assert isinstance(stolen, Rejected) and stolen.errors[0].field == f"{field}.name", stolen
        assert "no dataset named globex-private" in stolen.errors[0].reason
    shared = await submit_as(globex, "globex", node="n2", validation_dataset={"name": "globex-private"})
    assert isinstance(shared, Accepted), shared  # the tenant it was shared with may
    assert (await finished(globex, "globex", shared.job)).state == "succeeded"

    # 4. node n1 cannot store artifacts for G (run by n2), for a job that does not exist, or at a path
    forged = Chunk(
        upload="forged1",
        job=g,
        kind="peft",
        seq=0,
        data=b"evil",
        last=True,
        sha256=__import__("hashlib").sha256(b"evil").hexdigest(),
        size=4,
        meta=ArtifactMeta(tenant="acme", attempt=1),
    )
    ack = _ack.decode(
        (await n1.nc.request(names.artifact_upload("n1", g), msgspec.msgpack.encode(forged), timeout=10)).data
    )
    assert not ack.ok and "only the node running the job's current attempt" in ack.error, ack
    before = len(n1.violations)
    await n1.nc.publish(names.artifact_upload("n2", g), msgspec.msgpack.encode(forged))  # as n2: not its subject
    await refused(n1, before)
    ghost = msgspec.structs.replace(forged, upload="forged2", job="nosuchjob")
    ack = _ack.decode(
        (await n1.nc.request(names.artifact_upload("n1", "nosuchjob"), msgspec.msgpack.encode(ghost), timeout=10)).data
    )
    assert not ack.ok and "no job nosuchjob" in ack.error
    for meta in ({"step": -5}, {"step": 1, "filename": "../../../etc/passwd"}):
        bad = {**msgspec.structs.asdict(forged), "upload": "forged3", "kind": "checkpoint", "meta": meta}
        ack = _ack.decode(
            (await n1.nc.request(names.artifact_upload("n1", g), msgspec.msgpack.encode(bad), timeout=10)).data
        )
        assert not ack.ok and "meta." in ack.error, ack
    after = await job_as(globex, "globex", g)
    assert [(a.name, a.sha256) for a in after.artifacts] == artifacts_before

    # 7. globex follows its own job's events as a tenant; acme may not subscribe to them
    seen = [ev async for ev in follow(globex.nc, g, tenant="globex")]
    assert isinstance(seen[-1], StateChange) and seen[-1].state == "succeeded"
    assert sum(isinstance(ev, Progress) for ev in seen) >= 1
    before = len(acme.violations)
    await acme.nc.subscribe(names.tenant_events("globex"))
    await refused(acme, before)
    before = len(acme.violations)
    await acme.nc.subscribe(names.job_events(g))  # every tenant's token at once
    await refused(acme, before)

    # 8. what n1 says about G on its own subjects is not G's history
    js = n1.nc.jetstream()
    own = names.job(g, "n1", "globex")
    await js.publish(
        own.state, msgspec.json.encode(StateChange(job=g, state="failed", node="n1", attempt=1, message="forged by n1"))
    )
    await js.publish(own.progress, msgspec.json.encode(Progress(job=g, step=999, steps=999)))
    await js.publish(own.samples, msgspec.json.encode(Samples(job=g, step=999, model="adapter", samples=[])))
    page = await bus.request(globex.nc, names.jobs_api("globex").events, EventsQuery(job=g, limit=1000), EventPage)
    assert {e.node for e in page.events} == {"n2"}
    assert not any(
        getattr(e.event, "step", 0) == 999 or "forged" in getattr(e.event, "message", "") for e in page.events
    )
    assert (await job_as(globex, "globex", g)).state == "succeeded"

    # 9. control characters are refused at the door, naming the field
    escaped = await submit_as(acme, "acme", label="\x1b[2J\x1b[31mpwned\n\x00")
    assert isinstance(escaped, Rejected) and escaped.errors[0].field == "label", escaped
    assert stored.tenants == ["globex"]


async def test_a_tenant_reads_replies_only_on_its_own_inbox(secured):  # noqa: F811
    """nats-py's default inbox (_INBOX.<random>) is not the user's own: its requests get no reply at all."""
    scheduler = await as_user(secured.url, "scheduler")
    await bus.ensure_resources(scheduler.nc)

    async def quiet(_error) -> None:
        pass

    wrong = await nats.connect(
        secured.url, user="tenant-acme", password=password("tenant-acme"), error_cb=quiet, max_reconnect_attempts=1
    )
    with pytest.raises(nats.errors.Error):
        await wrong.request(names.jobs_api("acme").jobs, b"{}", timeout=1)
    await wrong.close()
    await scheduler.nc.close()


async def test_a_tenants_datasets_are_its_own(fleet, tmp_path):
    """acme uploads, lists, shows, trains on and deletes its own dataset on its own subjects; globex sees none of it,
    cannot train on it or delete it, and may not publish on acme's dataset subjects at all."""
    from schemas.datasets import DatasetDeleted, DatasetList, DatasetListQuery, DatasetQuery, DatasetReply
    from schemas.jobs import Error

    acme, globex = [await fleet.user(u) for u in ("tenant-acme", "tenant-globex")]
    rows = tmp_path / "acme.jsonl"
    rows.write_text("".join(json.dumps({"q": f"acme {i}?", "a": f"secret {i}"}) + "\n" for i in range(6)))
    stored = await upload_dataset(acme.nc, "private", rows, tenant="acme")
    assert stored.owner == "acme" and stored.name == "private"
    mine = await bus.request(acme.nc, names.datasets_api("acme").list, DatasetListQuery(), DatasetList)
    assert [(d.name, d.owner) for d in mine.datasets] == [("private", "acme")]
    theirs = await bus.request(globex.nc, names.datasets_api("globex").list, DatasetListQuery(), DatasetList)
    assert theirs.datasets == []
    for verb in ("show", "delete"):
        reply = await bus.request(
            globex.nc,
            getattr(names.datasets_api("globex"), verb),
            DatasetQuery(name="private"),
            DatasetReply | DatasetDeleted | Error,
        )
        assert isinstance(reply, Error) and reply.field == "name", reply
    stolen = await submit_as(globex, "globex", data=[], dataset={"name": "private"})
    assert isinstance(stolen, Rejected) and stolen.errors[0].field == "dataset.name", stolen
    before = len(globex.violations)
    await globex.nc.publish(names.datasets_api("acme").delete, msgspec.json.encode(DatasetQuery(name="private")))
    await refused(globex, before)

    own = await submit_as(acme, "acme", data=[], dataset={"name": "private"}, node="n1")
    assert isinstance(own, Accepted), own
    assert (await finished(acme, "acme", own.job)).state == "succeeded"
    gone = await bus.request(acme.nc, names.datasets_api("acme").delete, DatasetQuery(name="private"), DatasetDeleted)
    assert gone.name == "private"


async def test_the_reserved_tenant_tokens_reach_nothing_an_admin_holds(stack, nc, tmp_path):
    """`_` is the admins' token in event and index subjects, `upload` the chunks': a request that names either as its
    tenant, from a user whose permissions would let it (the gateway's wildcards did), is refused by every service
    naming `tenant`, and what an admin holds is unchanged. `jetlora.api._.jobs` listed the admins' jobs, and
    `jetlora.api._.submit` stored a job as tenant `_`."""
    from schemas.artifacts import ArtifactList, ArtifactQuery, Deleted
    from schemas.datasets import DatasetDeleted, DatasetList, DatasetListQuery, DatasetQuery, DatasetReply
    from schemas.jobs import Error
    from schemas.job_status import JobList, JobListQuery
    from services.transfer.sender import Refusal, upload_file
    from tests.conftest import answering, kv_keys, list_jobs, object_names, running_on

    await answering(nc, names.ARTIFACTS_LIST)
    admin_job = await bus.request(nc, names.SUBMIT, JOB, SubmitReply)  # no node: it stays queued
    assert isinstance(admin_job, Accepted), admin_job
    await running_on(nc, "adminjob")
    (tmp_path / "a.bin").write_bytes(b"adapter")
    await upload_file(nc, "n1", "adminjob", "peft", tmp_path / "a.bin")
    (tmp_path / "d.jsonl").write_text(json.dumps({"q": "admins' secret?", "a": "42"}) + "\n")
    await upload_dataset(nc, "admins", tmp_path / "d.jsonl")
    keys = await kv_keys(nc)

    def refused_naming_tenant(reply, token: str) -> None:
        errors = reply.errors if isinstance(reply, Rejected) else [reply]
        assert isinstance(reply, (Error, Rejected)), reply
        field = errors[0].field
        assert field == "tenant" and f"tenant {token!r}" in str(errors[0]) and "reserved" in str(errors[0]), reply

    for token in sorted(names.RESERVED_TENANTS):
        api, arts = names.jobs_api(token), names.artifacts_api(token)
        asks = [
            (api.jobs, JobListQuery(), JobList | Error),
            (api.submit, JOB, SubmitReply),
            (api.job, JobQuery(admin_job.job), JobReply | Error),
            (api.cancel, JobQuery(admin_job.job), JobReply | Error),
            (arts.list, ArtifactQuery(), ArtifactList | Error),
            (arts.delete, ArtifactQuery(job="adminjob"), Deleted | Error),
        ]
        if (
            token == names.ADMIN_TENANT
        ):  # jetlora.datasets.upload.<verb> is also an upload's subject (test_dataset_puts)
            data = names.datasets_api(token)
            asks += [
                (data.list, DatasetListQuery(), DatasetList | Error),
                (data.show, DatasetQuery(name="admins"), DatasetReply | Error),
                (data.delete, DatasetQuery(name="admins"), DatasetDeleted | Error),
            ]
        for subject, query, reply_type in asks:
            refused_naming_tenant(await bus.request(nc, subject, query, reply_type), token)
        with pytest.raises(Refusal, match=f"tenant {token!r} .* is reserved"):
            await upload_dataset(nc, "planted", tmp_path / "d.jsonl", tenant=token)

    assert await kv_keys(nc) == keys  # no job was stored under a reserved tenant
    assert [(j.id, j.state) for j in await list_jobs(nc)] == [(admin_job.job, "queued")]
    assert await object_names(nc) == ["adminjob/peft"]
    listed = await bus.request(nc, names.DATASETS.list, DatasetListQuery(), DatasetList)
    assert [(d.name, d.owner) for d in listed.datasets] == [("admins", None)]


async def test_a_tenant_can_neither_buy_priority_nor_name_a_dataset_after_a_verb(fleet, tmp_path):
    """With its own credentials: a priority above its ceiling (none given: 0) is refused naming `priority`, and a
    dataset named like a verb of its subjects is refused at the door, leaving nothing in the bucket."""
    from services.transfer.sender import Refusal

    acme = await fleet.user("tenant-acme")
    high = await submit_as(acme, "acme", priority=50)
    assert isinstance(high, Rejected) and high.errors[0].field == "priority", high
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"q": "a?", "a": "b"}) + "\n")
    for verb in ("list", "show", "delete"):
        with pytest.raises((Refusal, ValueError)):
            await upload_dataset(acme.nc, verb, rows, tenant="acme")
    listed = await bus.request(
        acme.nc, names.datasets_api("acme").list, msgspec.json.encode({}), msgspec.Raw, timeout=5
    )
    assert b'"datasets":[]' in bytes(listed).replace(b" ", b"")
    assert not acme.violations
