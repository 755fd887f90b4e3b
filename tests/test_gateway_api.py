"""The OpenAI-compatible gateway's lists, files and models, driven by OpenAI's own client against a real stack (the
stand-in trainer where a job must run): files and jobs paged and ordered as OpenAI pages them, the metadata filter,
each page costing its own objects' lookups however long the history; a job's events paged newest first; fine-tuned
models listed, shown and deleted; requests and their errors in OpenAI's terms; and `jetlora keys create --json`."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import nats
import openai
import pytest

from schemas import names, nats_subjects
from schemas.events import EventPage
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from tests.conftest import ROOT, wait_for, wait_nodes
from tests.test_dpo import preference_rows
from tests.test_gateway import chat_file, client_for, finished

LONG = "m" * 100  # a base model whose name leaves little room in the fine-tuned model's name


@pytest.fixture
async def gateway(stack, nc):
    models = {name: BaseModel(name, "/models/tiny", accelerator="cpu", served_by="llamacpp") for name in ("tiny", LONG)}
    await nc.jetstream().purge_stream(nats_subjects.kv(names.GATEWAY_JOBS_KV).stream)  # no job records of other tests
    gw = Gateway(nc, models, port=0)
    await gw.start()
    yield gw
    await gw.close()


class Requests:
    """What the gateway asks the services, seen from a connection of our own: each request's verb (`store` for a
    read of one message of a stream), and the replies to the requests on `subject`."""

    def __init__(self, url: str, subject: str) -> None:
        self.url, self.subject = url, subject
        self.asked: list[str] = []
        self.inboxes: set[str] = set()
        self.replies: list[bytes] = []

    async def __aenter__(self) -> "Requests":
        self.nc = await nats.connect(self.url)

        async def asked(msg):
            self.asked.append("store" if msg.subject.startswith("$JS.API") else msg.subject.rsplit(".", 1)[-1])
            if msg.subject == self.subject:
                self.inboxes.add(msg.reply)

        async def replied(msg):
            if msg.subject in self.inboxes:
                self.replies.append(msg.data)

        self.subs = [
            await self.nc.subscribe("jetlora.api.acme.>", cb=asked),
            await self.nc.subscribe("$JS.API.STREAM.MSG.GET.>", cb=asked),
            await self.nc.subscribe("_INBOX.>", cb=replied),
        ]
        await self.nc.flush()
        return self

    async def settle(self) -> None:
        """Until everything the server routed to us before now has been through the callbacks."""
        await self.nc.flush()
        await wait_for(lambda: all(s.pending_msgs == 0 for s in self.subs), 10, what="the callbacks")

    async def __aexit__(self, *exc) -> None:
        await self.settle()
        await self.nc.close()

    def clear(self) -> None:
        self.asked.clear(), self.replies.clear()


async def upload(client, path) -> str:
    with open(path, "rb") as f:
        return (await client.files.create(file=f, purpose="fine-tune")).id


async def test_files_are_paged_and_ordered_as_openai_lists_them(nc, gateway, tmp_path):
    client = await client_for(nc, gateway, "acme")
    ids = [await upload(client, chat_file(tmp_path / f"{i}.jsonl")) for i in range(3)]  # oldest first
    first = await client.files.list(limit=2)
    assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
    rest = await client.files.list(limit=2, after=first.data[-1].id)
    assert [f.id for f in rest.data] == ids[:1] and not rest.has_more
    assert [f.id for f in (await client.files.list(order="asc")).data] == ids
    assert [f.id async for f in client.files.list(limit=1, order="asc")] == ids  # the client follows has_more
    for kwargs, param in (({"after": "file-nope"}, "after"), ({"order": "sideways"}, "order"), ({"limit": 0}, "limit")):
        with pytest.raises(openai.BadRequestError) as e:
            await client.files.list(**kwargs)
        assert e.value.param == param, e.value.message


async def test_jobs_are_paged_at_the_cost_of_the_page(nats_server, nc, gateway, tmp_path):
    client = await client_for(nc, gateway, "acme")
    file = await upload(client, chat_file(tmp_path / "d.jsonl"))
    made = [(await client.fine_tuning.jobs.create(model="tiny", training_file=file)).id for _ in range(15)]
    jobs = made[::-1]  # newest first, as listed
    async with Requests(nats_server.url, "") as seen:
        page = await client.fine_tuning.jobs.list(limit=2, after=jobs[4])
        assert [j.id for j in page.data] == jobs[5:7] and page.has_more
        await seen.settle()
        asked = [a for a in seen.asked if a != "store"]
        assert sorted(asked) == ["job", "job"], seen.asked  # the two shown, never the history before them
        assert seen.asked.count("store") <= 8, seen.asked  # `after`'s record, the page's three and the one past them
        seen.clear()
        with pytest.raises(openai.BadRequestError) as e:
            await client.fine_tuning.jobs.list(after="0123456789abcdef")
        await seen.settle()
        assert e.value.param == "after" and "last_id" in e.value.message
        assert seen.asked.count("store") <= 2 and len(seen.asked) == seen.asked.count("store"), seen.asked
    assert [j.id async for j in client.fine_tuning.jobs.list(limit=4)] == jobs


async def test_jobs_are_filtered_by_metadata(nc, gateway, tmp_path):
    client = await client_for(nc, gateway, "acme")
    file = await upload(client, chat_file(tmp_path / "d.jsonl"))
    teams = [{"team": "geo"}, None, {"team": "bio", "tier": "1"}, {"team": "bio", "tier": "2"}]
    jobs = [(await client.fine_tuning.jobs.create(model="tiny", training_file=file, metadata=m)).id for m in teams]
    bio = await client.fine_tuning.jobs.list(metadata={"team": "bio"})
    assert [j.id for j in bio.data] == [jobs[3], jobs[2]] and bio.data[1].metadata == {"team": "bio", "tier": "1"}
    tier1 = await client.fine_tuning.jobs.list(metadata={"team": "bio", "tier": "1"}, limit=1)
    assert [j.id for j in tier1.data] == [jobs[2]] and not tier1.has_more
    assert (await client.fine_tuning.jobs.list(metadata={"team": "bio", "tier": "3"})).data == []
    bare = await client.fine_tuning.jobs.list(extra_query={"metadata": "null"})
    assert [j.id for j in bare.data] == [jobs[1]]
    with pytest.raises(openai.BadRequestError) as e:
        await client.fine_tuning.jobs.list(extra_query={"metadata": "none"})
    assert e.value.param == "metadata"


async def test_requests_and_their_errors_speak_openais_terms(nc, gateway, tmp_path):
    client = await client_for(nc, gateway, "acme")
    chat = await upload(client, chat_file(tmp_path / "chat.jsonl"))
    prefs = await upload(client, chat_file(tmp_path / "prefs.jsonl", preference_rows()))
    suffix = "s" * 64  # OpenAI's longest, on a model whose name leaves little room
    job = await client.fine_tuning.jobs.create(model=LONG, training_file=chat, suffix=suffix)
    assert job.status == "queued" and job.user_provided_suffix == suffix
    with pytest.raises(openai.BadRequestError) as e:
        await client.fine_tuning.jobs.create(model="tiny", training_file=chat, suffix=suffix + "s")
    assert e.value.param == "suffix" and "1-64" in e.value.message, e.value.message

    for file, method, says in (
        (prefs, {"type": "supervised"}, "method.type"),
        (chat, {"type": "dpo"}, "a file of preference pairs"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await client.fine_tuning.jobs.create(model="tiny", training_file=file, method=method)
        message = e.value.body["message"]  # the error's own text (e.value.message adds the status)
        assert e.value.param == "training_file" and message.startswith("training_file: ") and says in message
        assert not any(word in message for word in ("train.method", "dataset", "jetlora")), message


async def test_a_jobs_events_page_newest_first_at_the_cost_of_the_page(nats_server, nc, gateway, agents, tmp_path):
    agents.start("n1", gpus=None, offer_cpu=True, hold_s=1.0, env={"HOLD_STEPS": "300"})
    await wait_nodes(nc, 1)
    client = await client_for(nc, gateway, "acme")
    file = await upload(client, chat_file(tmp_path / "d.jsonl"))
    done = await finished(client, (await client.fine_tuning.jobs.create(model="tiny", training_file=file)).id, 60)
    assert done.status == "succeeded", (done.error, agents.log("n1")[-2000:])

    every = [e async for e in client.fine_tuning.jobs.list_events(done.id, limit=50)]  # 7 pages of 50
    seqs = [int(e.id.split("-")[1]) for e in every]
    assert seqs == sorted(set(seqs), reverse=True) and every[0].message.startswith("succeeded")
    steps = [e.data["step"] for e in every if e.type == "metrics"]
    assert steps == list(range(300, 0, -1)), steps[:5]
    async with Requests(nats_server.url, "jetlora.api.acme.events") as seen:
        page = await client.fine_tuning.jobs.list_events(done.id, limit=5, after=every[100].id)
        assert [e.id for e in page.data] == [e.id for e in every[101:106]] and page.has_more
    read = sum(len(msgspec.json.decode(r, type=EventPage).events) for r in seen.replies)
    assert 0 < read < 150, f"a page of 5 read {read} of the job's {len(every)} events"
    with pytest.raises(openai.BadRequestError) as e:
        await client.fine_tuning.jobs.list_events(done.id, after="ftevent-999999")  # no event of this job
    assert e.value.param == "after"


async def test_fine_tuned_models_are_listed_shown_and_deleted_per_tenant(nc, gateway, agents, tmp_path):
    agents.start("n1", gpus=None, offer_cpu=True, hold_s=0.3, env={"HOLD_STEPS": "3"})
    await wait_nodes(nc, 1)
    acme, globex = await client_for(nc, gateway, "acme"), await client_for(nc, gateway, "globex")
    file = await upload(acme, chat_file(tmp_path / "d.jsonl"))
    job = await acme.fine_tuning.jobs.create(model="tiny", training_file=file, suffix="geo")
    done = await finished(acme, job.id, 60)
    assert done.status == "succeeded", (done, agents.log("n1")[-2000:])
    name = done.fine_tuned_model

    async def listed(client):
        return [m.id for m in (await client.models.list()).data]

    await wait_for(lambda: _has(acme, name), 30, what="the fine-tuned model registered")
    assert sorted(await listed(acme)) == sorted(["tiny", LONG, name])
    shown = await acme.models.retrieve(name)
    assert shown.owned_by == "acme" and shown.created > 0 and shown.object == "model"
    assert name not in await listed(globex)
    for ask in (globex.models.retrieve(name), globex.models.delete(name)):
        with pytest.raises(openai.NotFoundError):
            await ask
    with pytest.raises(openai.PermissionDeniedError):
        await acme.models.delete("tiny")

    deleted = await acme.models.delete(name)
    assert deleted.id == name and deleted.deleted
    assert name not in await listed(acme)
    with pytest.raises(openai.NotFoundError):
        await acme.models.retrieve(name)
    with pytest.raises(openai.BadRequestError) as e:  # no longer a model to go on from
        await acme.fine_tuning.jobs.create(model=name, training_file=file)
    assert e.value.param == "model"


async def _has(client, name: str) -> bool:
    return name in [m.id for m in (await client.models.list()).data]


def test_keys_create_prints_json_and_a_bad_tenant_is_a_message(nats_server):
    def keys(*args):
        cmd = [sys.executable, "-m", "services.cli", "keys", *args, "--nats", nats_server.url]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)

    made = keys("create", "--tenant", "acme", "--label", "ci", "--json")
    assert made.returncode == 0, made.stderr
    shown = json.loads(made.stdout)
    assert shown["tenant"] == "acme" and shown["label"] == "ci" and shown["key"].startswith(f"jl-{shown['id']}-")
    assert shown["tinker_key"] == "tml-" + shown["key"]  # the form the tinker client takes
    listed = keys("ls", "--json")
    assert shown["id"] in [k["id"] for k in json.loads(listed.stdout)]
    bad = keys("create", "--tenant", "no.such", "--json")
    assert bad.returncode == 1 and "--tenant" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
