"""Eval runs through the engine that serves the name, end to end (real nats-server; the scheduler, artifact service,
registry and evals service in-process; the agent a process; its engine a small real server speaking vLLM's LoRA,
completions and chat APIs, tests/lora_engine.py). `jetlora evals run capq --model capitals` of the version capitals
serves goes to n1, whose engine has it loaded: the agent answers the eval's items through the engine under the
served name, grades them and replies; the evals service stores the results as a trainer-side run's, so the per-item
outputs read back are the engine's answers and `adapters show` lists the score, saying which engine sampled it.
`--via trainer`, a version the name does not serve, and an engine that fails all place the run as a trainer job (an
eval job: nothing here runs it), the record saying why."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time

import msgspec
import pytest
from nats.js.api import ObjectMeta

from schemas import names
from schemas.evals import (
    Criterion,
    EvalCreate,
    EvalReply,
    EvalRun,
    ItemsPage,
    ItemsQuery,
    RunQuery,
    RunReply,
    RunRequest,
)
from schemas.artifacts import ArtifactMeta
from schemas.jobs import Error, JobRequest
from schemas.object_headers import artifact_headers, sha256_header
from schemas.registry import AdapterReply, AdapterVersion, PromoteRequest, StoredFile
from services import bus
from services.cli.evals import version_scores
from services.evals.service import EvalsService
from services.job_records import JobRecords
from services.registry.store import AdapterRegistry
from services.transfer.sender import upload_dataset
from tests.conftest import ROOT, wait_for
from tests.lora_engine import LoraEngine
from tests.test_dataset_formats import data_file
from tests.test_gated_canary import ADAPTER_LOGPROB, ANSWERS, ITEMS, SAYS_ANSWER, probe, right
from tests.test_registry import serving
from tests.test_registry_lifecycle import peft_archive

API = names.evals_api()
TINY = {"base_dir": "/models/tiny", "accelerator": "gpu"}
PLACED = ("queued", "in_progress")


@pytest.fixture
async def served(nc, stack, services, agents, tmp_path):
    """Eval capq (a string_check) over the capitals' rft items; capitals@1 served verified by n1's engine (which
    answers every question right), @2 registered and not promoted. n1's trainer is a stand-in that holds what it
    runs: a trainer job is placed, and never ends here."""
    evals, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(evals.ready.is_set, timeout=10, what="the evals service")
    rows = [{"messages": [{"role": "user", "content": i["question"]}], "answer": i["answer"]} for i in ITEMS]
    await upload_dataset(nc, "capq-items", data_file(tmp_path / "items.jsonl", "rft", rows).path)
    criteria = [msgspec.convert({"grader": SAYS_ANSWER}, Criterion)]
    create = EvalCreate(name="capq", dataset="capq-items", criteria=criteria, replace=True)
    made = await bus.request(nc, API.create, create, EvalReply | Error)
    if isinstance(made, Error):  # (the evals bucket outlives a test: replace it, or make it the first time)
        made = await bus.request(nc, API.create, msgspec.structs.replace(create, replace=False), EvalReply | Error)
    assert isinstance(made, EvalReply), made
    engine = await LoraEngine().start()
    engine.logprobs["capitals"] = ADAPTER_LOGPROB
    engine.answers["capitals"] = right
    extra = ("--engine", f"vllm={engine.url}", "--engine-model", "tiny")
    agents.start("n1", hold_s=120, extra=extra)  # a stand-in trainer that holds a job it is given
    registry = AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))
    for n in (1, 2):
        peft = await archive(nc, f"job-cap{n}", peft_archive(f"cap{n}"))
        draft = AdapterVersion(
            name="capitals", version=1, job=f"job-cap{n}", base_model="tiny", peft=peft, r=8, alpha=16,
            target_modules=["q_proj"], probe=probe(ADAPTER_LOGPROB),
        )  # fmt: skip
        await registry.add_version(draft)
    promoted = await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="capitals", version=1), AdapterReply)
    assert promoted.alias.current == 1
    await serving(nc, "capitals", {"n1": (1, "loaded")})
    try:
        yield engine
    finally:
        await engine.stop()


async def archive(nc, job: str, data: bytes) -> StoredFile:
    """A job's PEFT archive as the artifact service stores it, its sha256 with it (a trainer job fetches it)."""
    name, sha256 = names.artifact_name(job, "peft"), hashlib.sha256(data).hexdigest()
    headers = artifact_headers(job, "peft", ArtifactMeta()) | dict([sha256_header(sha256)])
    obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    await obs.put(name, data, meta=ObjectMeta(name=name, headers=headers))
    return StoredFile(name=name, sha256=sha256, size=len(data))


async def ended(nc, run: str) -> EvalRun | None:
    r = (await bus.request(nc, API.run_show, RunQuery(run=run), RunReply)).run
    return r if r.state in ("completed", "failed", "canceled") else None


async def job_request(nc, job: str) -> JobRequest:
    found = await (await JobRecords.open(nc.jetstream())).find(job)
    assert found is not None, job
    return found.stored.request


async def cli(nats_url: str, *argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", *argv, "--nats", nats_url, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_an_eval_run_of_a_served_name_samples_through_its_engine(nc, served, nats_server):
    started = time.monotonic()
    code, out, err = await cli(
        nats_server.url, "evals", "run", "capq", "--model", "capitals", "--base-dir", "/models/tiny", "--wait", "60"
    )
    print(f"\nthrough the engine in {time.monotonic() - started:.1f}s: {out}")
    assert code == 0 and "completed" in out and f"via engine vllm {served.url} on n1" in out, (out, err)
    run_id = out.split()[0]
    run = (await bus.request(nc, API.run_show, RunQuery(run=run_id), RunReply)).run
    assert (run.state, run.job, run.model, run.via) == (
        "completed",
        "",
        "capitals@1",
        f"engine vllm {served.url} on n1",
    )
    assert run.via_note == "auto: an engine serves it" and run.results == f"{run_id}/eval", run
    [says] = run.summary.graders
    assert (says.name, says.mean, says.low, says.high, says.passed) == ("says_answer", 1.0, 1.0, 1.0, len(ITEMS))

    page = await bus.request(nc, API.items, ItemsQuery(run=run_id), ItemsPage)  # as the trainer's are read back
    assert page.via == run.via and [i.index for i in page.items] == list(range(len(ITEMS)))
    for i in page.items:
        assert i.outputs == [right(i.input)] and i.item["answer"] == ANSWERS[i.input[-1]["content"]], i
        assert i.scores == {"says_answer": [1.0]} and i.passed == {"says_answer": [True]}
    chats = served.chats  # the items, greedy, under the served name
    assert len(chats) == len(ITEMS) and {c["model"] for c in chats} == {"capitals"}
    assert all(c["temperature"] == 0 and c["max_tokens"] == 64 for c in chats)

    shown = "\n".join(await version_scores(nc, None, "capitals"))
    assert run_id in shown and "says_answer 1.000" in shown and f"via engine vllm {served.url} on n1" in shown, shown
    code, _, err = await cli(nats_server.url, "evals", "results", run_id)
    assert code == 0 and f"sampled by engine vllm {served.url} on n1" in err, err


async def test_the_trainer_samples_what_no_engine_serves_or_is_asked_to(nc, served):
    async def placed(**more) -> EvalRun:
        reply = await bus.request(nc, API.run, RunRequest(eval="capq", **TINY, **more), RunReply | Error)
        assert isinstance(reply, RunReply), reply
        return reply.run

    forced = await placed(adapter="capitals", via="trainer")
    assert (forced.via, forced.via_note, forced.state) == ("trainer", "--via trainer asked for the trainer", "queued")
    job = await job_request(nc, forced.job)  # an eval job, as before: the trainer samples it on a node of the base
    assert job.train.method == "eval" and job.evaluate is not None and job.evaluate.run == forced.id
    assert job.init_adapter is not None and (job.init_adapter.name, job.init_adapter.version) == ("capitals", 1)

    unserved = await placed(adapter="capitals", version=2)
    assert unserved.via == "trainer" and unserved.job, unserved
    assert unserved.via_note == "capitals@2 is not what capitals serves now (@1), so no engine serves it"
    refused = await bus.request(
        nc, API.run, RunRequest(eval="capq", adapter="capitals", version=2, via="engine", **TINY), RunReply | Error
    )
    assert isinstance(refused, Error) and refused.field == "via" and "not what capitals serves now" in refused.error

    def broken(messages: list[dict]) -> str:
        raise RuntimeError("the engine broke")

    served.answers["capitals"] = broken  # the engine answers 500: the agent says so, and the run goes to the trainer
    fallen = await placed(adapter="capitals")
    assert fallen.state == "in_progress" and fallen.via.startswith("engine"), fallen

    async def queued() -> EvalRun | None:
        r = (await bus.request(nc, API.run_show, RunQuery(run=fallen.id), RunReply)).run
        return r if r.job else None

    moved = await wait_for(queued, timeout=30, what="the run to fall back to the trainer")
    assert moved.via == "trainer" and moved.state in PLACED, moved
    assert moved.via_note.startswith("no engine sampled it: node n1: item ") and "(500)" in moved.via_note, moved
    assert moved.via_note.endswith("sampled by the trainer instead")
    assert (await job_request(nc, moved.job)).evaluate.run == fallen.id

    forced_engine = await placed(adapter="capitals", via="engine")  # forced: it fails rather than fall back
    failed = await wait_for(lambda: ended(nc, forced_engine.id), timeout=30, what="the forced engine run to fail")
    assert failed.state == "failed" and failed.message.startswith("--via engine: no engine sampled it: node n1"), failed
    assert not failed.job
