"""Datasets over the bus (real nats-server): uploaded once and checked row by row, refused whole on one bad row,
named by jobs (missing names and wrong pins refused at submit), fetched once per node and reused."""

from __future__ import annotations

import hashlib
import json

import msgspec
import pytest

from schemas import names, nats_subjects
from schemas.datasets import (
    DatasetDeleted,
    DatasetLimits,
    DatasetList,
    DatasetListQuery,
    DatasetQuery,
    DatasetReply,
    DatasetUpload,
)
from schemas.jobs import Accepted, Error, Rejected
from schemas.job_status import StoredRequest
from services import bus
from schemas.dataset_check import DatasetChecker, DatasetInvalid, check_file
from services.transfer.sender import Refusal, upload_dataset
from tests.conftest import submit, wait_nodes, wait_state
from tests.qa import QA_PAIRS


def chat_rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": QA_PAIRS[i % len(QA_PAIRS)][0]},
                {"role": "assistant", "content": QA_PAIRS[i % len(QA_PAIRS)][1]},
            ]
        }
        for i in range(n)
    ]


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def stored_objects(nc) -> int:
    """Messages in the datasets bucket's stream: chunks and entries alike."""
    info = await nc.jetstream().stream_info(nats_subjects.objects(names.DATASETS_BUCKET).stream)
    return info.state.messages


async def test_an_upload_is_checked_stored_and_described(stack, nc, tmp_path):
    sha = write_rows(tmp_path / "chat.jsonl", chat_rows(100))
    info = await upload_dataset(
        nc, "chat-v1", tmp_path / "chat.jsonl", DatasetUpload(description="capitals"), chunk_bytes=1024
    )  # rows cross chunk boundaries
    assert info.sha256 == sha and info.stats.format == "chat" and info.stats.rows == 100
    assert info.stats.roles == {"user": 100, "assistant": 100} and info.stats.turns_trained == 100
    shown = await bus.request(nc, names.DATASETS.show, DatasetQuery(name="chat-v1"), DatasetReply | Error)
    assert shown.dataset == info and json.loads(shown.dataset.stats.head[0]) == chat_rows(1)[0]
    listed = await bus.request(nc, names.DATASETS.list, DatasetListQuery(), DatasetList)
    assert [d.name for d in listed.datasets] == ["chat-v1"]
    assert (await bus.request(nc, names.DATASETS.list, DatasetListQuery(format="qa"), DatasetList)).datasets == []

    with pytest.raises(Refusal, match="a dataset named chat-v1 exists.*--replace"):
        await upload_dataset(nc, "chat-v1", tmp_path / "chat.jsonl")
    write_rows(tmp_path / "qa.jsonl", [{"q": q, "a": a} for q, a in QA_PAIRS])
    replaced = await upload_dataset(nc, "chat-v1", tmp_path / "qa.jsonl", DatasetUpload(replace=True))
    assert replaced.stats.format == "qa" and replaced.stats.rows == len(QA_PAIRS)

    gone = await bus.request(nc, names.DATASETS.delete, DatasetQuery(name="chat-v1"), DatasetDeleted | Error)
    assert gone == DatasetDeleted("chat-v1")
    missing = await bus.request(nc, names.DATASETS.show, DatasetQuery(name="chat-v1"), DatasetReply | Error)
    assert isinstance(missing, Error) and missing.field == "name" and "jetlora datasets ls" in missing.error


async def test_a_file_with_a_byte_order_mark_and_crlf_lines_is_taken(stack, nc, tmp_path):
    """Excel and Windows tools begin a UTF-8 file with a BOM and end lines with CRLF: the file is taken as it is (its
    bytes and sha256 unchanged), and its first row shown without either."""
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in chat_rows(3)).encode())
    info = await upload_dataset(nc, "windows", path)
    assert info.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and info.stats.rows == 3
    assert info.stats.head[0] == json.dumps(chat_rows(1)[0])


async def test_one_bad_row_deep_inside_refuses_the_whole_file(stack, nc, tmp_path):
    """The service refuses at the first bad row (the rest of a large file is not sent for nothing); the file's other
    bad rows are what the command's own check lists (test_cli.py)."""
    rows = chat_rows(3000)
    rows[1203]["messages"][1]["role"] = "asistant"  # line 1,204
    rows[2500] = {"messages": [{"role": "user", "content": 5}]}  # line 2,501
    write_rows(tmp_path / "bad.jsonl", rows)
    with pytest.raises(Refusal) as refused:
        await upload_dataset(nc, "bad", tmp_path / "bad.jsonl", chunk_bytes=4096)
    text = str(refused.value)
    assert text.startswith("line 1,204: message 2 has role 'asistant'; roles are system, user, assistant"), text
    assert "nothing was stored" in text and "line 2,501" not in text
    with pytest.raises(DatasetInvalid) as listed_here:
        check_file(tmp_path / "bad.jsonl")
    assert "line 2,501: messages[0].content: Expected `str`, got `int`" in str(listed_here.value)
    assert await stored_objects(nc) == 0  # not one chunk left behind
    listed = await bus.request(nc, names.DATASETS.list, DatasetListQuery(), DatasetList)
    assert listed.datasets == []


class LineByLine(DatasetChecker):
    """The checker with its many-rows-at-once path off: what every row's verdict must equal."""

    def _block(self, data: bytes, end: int) -> bool:
        return False


def verdict(checker: DatasetChecker, data: bytes, piece: int):
    try:
        for i in range(0, len(data), piece):
            checker.feed(data[i : i + piece])
        return checker.finish()
    except DatasetInvalid as e:
        return e.errors


@pytest.mark.parametrize("piece", [700, 4096, 1 << 20])
def test_rows_checked_many_at_once_get_the_verdict_of_one_by_one(piece):
    """Blank and CRLF lines, two rows on one line, bad JSON, a wrong type, a broken rule, in every format: the same
    stats or the same errors at the same lines, whatever pieces the file arrives in."""
    rows = [json.dumps(r) for r in chat_rows(400)]
    rows[50] = ""  # a blank line
    rows[120] = rows[120] + "\r"
    rows[200] = rows[200] + ", " + rows[201]  # two rows on one line
    rows[260] = rows[260][:-3]  # cut short
    rows[300] = json.dumps({"messages": [{"role": "user", "content": 5}]})
    rows[350] = json.dumps({"messages": [{"role": "user", "content": "hi", "weight": 1}]})
    rows[360] = json.dumps({"messages": [{"role": "bot", "content": "hi"}]})
    rows[370] = json.dumps({"messages": []})
    rows[380] = json.dumps(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 2}]}
    )
    rows[390] = json.dumps(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}]}
    )
    clean = rows[:50] + rows[51:120] + rows[121:200] + rows[201:260]
    files = {
        "clean": clean,
        "bad": rows,
        "a blank line and a line of two rows in one piece": clean[:100]
        + ["  "]
        + clean[101:110]
        + [clean[110] + " " + clean[111]]
        + clean[112:],
        "qa": [json.dumps({"q": q, "a": a if i != 70 else " "}) for i, (q, a) in enumerate(QA_PAIRS * 20)],
    }
    for name, lines in files.items():
        data = ("\n".join(lines) + "\n").encode()
        for limits in (DatasetLimits(), DatasetLimits(max_errors=1)):
            expected = verdict(LineByLine("auto", limits), data, piece)
            assert verdict(DatasetChecker("auto", limits), data, piece) == expected, name
            assert isinstance(expected, list) == (name != "clean"), expected


async def test_limits_and_unknown_shapes_are_refused_with_the_fix(services, nc, tmp_path):
    from services.artifacts.service import ArtifactService

    await services.start(lambda c: ArtifactService(c, dataset_limits=DatasetLimits(max_rows=20, max_row_bytes=2000)))
    (tmp_path / "odd.jsonl").write_text('{"prompt": "x", "completion": "y"}\n')
    with pytest.raises(Refusal, match=r"fit no format .*say --format"):
        await upload_dataset(nc, "odd", tmp_path / "odd.jsonl")
    (tmp_path / "both.jsonl").write_text('{"q": "a", "a": "b", "text": "c"}\n')
    with pytest.raises(Refusal, match="fits several formats"):
        await upload_dataset(nc, "both", tmp_path / "both.jsonl")
    ok = await upload_dataset(nc, "both", tmp_path / "both.jsonl", DatasetUpload(format="text"))
    assert ok.stats.format == "text"
    write_rows(tmp_path / "long.jsonl", [{"text": "short"}, {"text": "x" * 5000}])
    with pytest.raises(Refusal, match=r"line 2 is over 2,000 bytes, the limit of one row \(max_row_bytes\)"):
        await upload_dataset(nc, "long", tmp_path / "long.jsonl", chunk_bytes=1024)
    write_rows(tmp_path / "many.jsonl", [{"text": "row"}] * 21)
    with pytest.raises(Refusal, match=r"more than 20 rows, the service's limit \(max_rows\)"):
        await upload_dataset(nc, "many", tmp_path / "many.jsonl")
    listed = await bus.request(nc, names.DATASETS.list, DatasetListQuery(), DatasetList)
    assert [d.name for d in listed.datasets] == ["both"]


async def test_a_job_naming_a_missing_dataset_or_a_wrong_pin_is_refused_at_submit(stack, nc, tmp_path):
    sha = write_rows(tmp_path / "chat.jsonl", chat_rows(10))
    await upload_dataset(nc, "chat", tmp_path / "chat.jsonl")
    base = {"model": "tiny", "base_dir": "/models/tiny"}
    missing = await submit(nc, {**base, "dataset": {"name": "nope"}})
    assert isinstance(missing, Rejected) and missing.errors[0].field == "dataset.name"
    assert "no dataset named nope" in missing.errors[0].reason
    wrong = await submit(nc, {**base, "dataset": {"name": "chat", "sha256": "0" * 64}})
    assert isinstance(wrong, Rejected) and wrong.errors[0].field == "dataset.sha256" and sha in wrong.errors[0].reason
    bad_validation = await submit(nc, {**base, "dataset": {"name": "chat"}, "validation_dataset": {"name": "held"}})
    assert isinstance(bad_validation, Rejected) and bad_validation.errors[0].field == "validation_dataset.name"
    few = await submit(nc, {**base, "dataset": {"name": "chat"}, "train": {"eval_fraction": 0.05}})
    assert isinstance(few, Rejected) and few.errors[0].field == "train.eval_fraction"
    neither = await submit(nc, base)
    assert (
        isinstance(neither, Rejected)
        and neither.errors[0].field == "data"
        and "name a dataset" in neither.errors[0].reason
    )
    both = await submit(nc, {**base, "data": [{"q": "x", "a": "y"}], "dataset": {"name": "chat"}})
    assert isinstance(both, Rejected) and both.errors[0].field == "data"

    accepted = await submit(nc, {**base, "dataset": {"name": "chat"}})
    assert isinstance(accepted, Accepted)
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    stored = msgspec.json.decode((await kv.get(f"request.{accepted.job}")).value, type=StoredRequest)
    assert stored.request.dataset.sha256 == sha and stored.request.data == []  # the pin, not the rows


async def test_two_jobs_on_one_dataset_fetch_it_once(stack, nc, agents, tmp_path):
    sha = write_rows(tmp_path / "chat.jsonl", chat_rows(2000))
    await upload_dataset(nc, "shared", tmp_path / "chat.jsonl")
    agents.start("n1", gpus="4096", hold_s=0.2)
    await wait_nodes(nc, 1)
    for _ in range(2):
        reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "dataset": {"name": "shared"}})
        assert isinstance(reply, Accepted), reply
        await wait_state(nc, reply.job, "succeeded", timeout=60)
    log = agents.log("n1")
    assert log.count("fetched into") == 1, log
    cached = tmp_path / "n1" / "datasets" / f"{sha}.jsonl"
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == sha


async def test_a_dataset_named_by_unfinished_jobs_is_deleted_only_when_forced(stack, nc, agents, tmp_path):
    """Deleting a dataset queued jobs name is refused, naming them; forced, it goes, and a job that had not fetched
    it fails saying so."""
    write_rows(tmp_path / "chat.jsonl", chat_rows(10))
    await upload_dataset(nc, "brief", tmp_path / "chat.jsonl")
    reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "dataset": {"name": "brief"}})
    assert isinstance(reply, Accepted)
    refused = await bus.request(nc, names.DATASETS.delete, DatasetQuery(name="brief"), DatasetDeleted | Error)
    assert isinstance(refused, Error) and refused.field == "name", refused
    assert f"{reply.job} (queued)" in refused.error and "--force" in refused.error, refused.error
    await bus.request(nc, names.DATASETS.delete, DatasetQuery(name="brief", force=True), DatasetDeleted)
    agents.start("n1", gpus="4096", hold_s=0.2)
    job = await wait_state(nc, reply.job, "failed", timeout=60)
    assert "dataset brief was deleted after the job was submitted" in job.message


def memory_kib(pid: int, field: str) -> int:
    """VmRSS (now) or VmHWM (the peak so far) of a process, in KiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


async def test_a_50_mib_dataset_goes_through_in_bounded_memory(services, nc, agents, nats_server, tmp_path):
    """Upload, check and store (artifact service), then fetch (agent): neither process grows by the file's size."""
    import subprocess
    import sys

    from services.scheduler.service import Scheduler
    from tests.conftest import ROOT, STACK_CONFIG, answering

    path = tmp_path / "big.jsonl"
    rows = chat_rows(len(QA_PAIRS))
    with open(path, "w") as f:
        n = 0
        while f.tell() < 50 * 2**20:
            f.write(
                json.dumps(
                    {"messages": [{"role": "system", "content": f"conversation {n}"}] + rows[n % len(rows)]["messages"]}
                )
                + "\n"
            )
            n += 1
    sched, *_ = await services.start(lambda c: Scheduler(c, STACK_CONFIG))
    log = open(tmp_path / "artifacts.log", "wb")
    service = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "artifacts", "--nats", nats_server.url],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        await answering(nc, names.DATASETS.list)
        before = memory_kib(service.pid, "VmRSS")
        info = await upload_dataset(nc, "big", path)
        service_growth = (memory_kib(service.pid, "VmHWM") - before) / 1024
        assert info.stats.rows == n and info.size == path.stat().st_size

        agent = agents.start("n1", gpus="4096", hold_s=0.2)
        await wait_nodes(nc, 1)
        before = memory_kib(agent.pid, "VmRSS")
        reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "dataset": {"name": "big"}})
        await wait_state(nc, reply.job, "succeeded", timeout=120)
        agent_growth = (memory_kib(agent.pid, "VmHWM") - before) / 1024
    finally:
        service.terminate()
        service.wait(30)
    print(
        f"50 MiB dataset ({n:,} rows): artifact service peak grew {service_growth:.1f} MiB, "
        f"agent {agent_growth:.1f} MiB"
    )
    assert service_growth < 48 and agent_growth < 48, (service_growth, agent_growth)


async def test_the_node_cache_keeps_its_budget_evicting_the_least_recently_used(stack, nc, agents, tmp_path):
    shas = {}
    for name in ("first", "second", "third"):
        rows = [{"messages": [{"role": "system", "content": name}] + r["messages"]} for r in chat_rows(2500)]
        shas[name] = write_rows(
            tmp_path / f"{name}.jsonl", rows
        )  # about 0.4 MiB each (two fit in 1 MiB), each its own sha256
        await upload_dataset(nc, name, tmp_path / f"{name}.jsonl")
    agent_dir = tmp_path / "n1"
    agents.start("n1", gpus="4096", hold_s=0.1, extra=("--dataset-cache-mib", "1"))
    await wait_nodes(nc, 1)
    for name in ("first", "second", "first", "third"):  # "first" used again: "second" is the least recent
        reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "dataset": {"name": name}})
        await wait_state(nc, reply.job, "succeeded", timeout=60)
    kept = {p.stem for p in (agent_dir / "datasets").glob("*.jsonl")}
    assert kept == {shas["first"], shas["third"]}, kept
    assert agents.log("n1").count("fetched into") == 3  # first, second, third: the second "first" was a hit

    # the budget counts tokenized copies too (the trainer's, written beside the rows): a copy of 0.8 MiB makes
    # "third" 1.2 MiB, so fetching "second" again evicts "first" and then "third" with its copy
    copy = agent_dir / "datasets" / "tokens" / f"{shas['third']}-0123456789abcdef"
    copy.mkdir(parents=True)
    (copy / "ids.bin").write_bytes(b"\0" * (800 << 10))
    reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "dataset": {"name": "second"}})
    await wait_state(nc, reply.job, "succeeded", timeout=60)
    kept = {p.stem for p in (agent_dir / "datasets").glob("*.jsonl")}
    assert kept == {shas["second"]} and not copy.exists(), kept
    assert "with its tokenized copies" in agents.log("n1")
