"""Who gets a dataset's name, against a real artifact service: a name that is a verb of the datasets API is refused at
every door (the client, the service, the `jetlora datasets` command: never a traceback), of two puts of one name
without --replace exactly one is stored and nothing of the other stays, and a refused upload is sent once."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import uuid

import msgspec
import pytest

from schemas import names, nats_subjects
from schemas.artifacts import Chunk
from schemas.datasets import DatasetChunk, DatasetChunkAck, DatasetUpload
from services.transfer.datasets import find_dataset
from services.transfer.sender import Refusal, upload_dataset, upload_file
from tests.conftest import ROOT, answering, wait_for
from tests.qa import QA_PAIRS

_ack = msgspec.json.Decoder(DatasetChunkAck)
DATASET_CHUNKS = nats_subjects.objects(names.DATASETS_BUCKET).prefix + "C.>"


def qa_file(path, rows: int, tag: str = "") -> bytes:
    data = "".join(json.dumps({"q": f"{tag}{q}", "a": a}) + "\n" for q, a in (QA_PAIRS * 4)[:rows]).encode()
    path.write_bytes(data)
    return data


async def send_chunk(nc, subject: str, chunk: DatasetChunk) -> DatasetChunkAck:
    return _ack.decode((await nc.request(subject, msgspec.msgpack.encode(chunk), timeout=10)).data)


def jetlora(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


async def test_a_dataset_named_like_a_verb_is_refused_at_every_door(stack, nc, nats_server, tmp_path):
    """`jetlora.datasets.upload.list` is also the request `jetlora.datasets.<tenant>.list`: such a put died with a
    raw ValidationError and its dataset was stored anyway. Now the client, the service and the command refuse it."""
    await answering(nc, names.DATASETS.list)
    data = qa_file(tmp_path / "rows.jsonl", 8)
    for verb in ("delete", "list", "show"):  # schemas.datasets.VERBS
        with pytest.raises(ValueError, match=f"dataset name '{verb}' is one of the datasets API's verbs"):
            await upload_dataset(nc, verb, tmp_path / "rows.jsonl")

    # the service, sent the chunks anyway: a tenant's upload (its subject collides with no request) is refused ...
    whole = dict(seq=0, data=data, last=True, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    ack = await send_chunk(
        nc, names.dataset_upload("list", "acme"), DatasetChunk(upload="t1", name="list", meta=DatasetUpload(), **whole)
    )
    assert not ack.ok and not ack.retry and "dataset name 'list'" in ack.error, ack
    # ... and so is an admin's, whichever of the two services on its subject answers first
    admin = DatasetChunk(upload="a1", name="delete", meta=DatasetUpload(), **whole)
    reply = (await nc.request(names.dataset_upload("delete"), msgspec.msgpack.encode(admin), timeout=10)).data
    assert b'"ok":true' not in reply, reply
    await upload_dataset(nc, "probe", tmp_path / "rows.jsonl")  # the receiver takes chunks in order: it saw both
    js = nc.jetstream()
    assert [await find_dataset(js, n) for n in ("acme/list", "delete")] == [None, None]

    # the command: exit 2 (rejected input) with the field and the fix, never a traceback
    url = nats_server.url
    for args, words in (
        (("put", str(tmp_path / "rows.jsonl"), "--name", "show"), ("dataset name 'show'", "give one with --name")),
        (("put", str(tmp_path / "rows.jsonl"), "--name", "x", "--tenant", "_"), ("--tenant", "reserved")),
        (("put", str(tmp_path / "rows.jsonl"), "--name", "x", "--share", "a.b"), ("--share", "tenant 'a.b'")),
        (("get", "a.b", "-o", str(tmp_path / "out")), ("dataset name 'a.b'",)),
        (("rm", "no/such"), ("dataset name 'no/such'",)),
    ):
        done = await asyncio.to_thread(jetlora, "datasets", *args, "--nats", url)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr)
        assert all(w in done.stderr for w in words), (args, done.stderr)
    assert await find_dataset(js, "show") is None


async def test_of_two_puts_of_one_name_without_replace_exactly_one_is_stored(stack, nc, tmp_path):
    """Both uploads begin while the name is free (the service's check at chunk 0 passes for both); the commit is
    conditional on the name's entry not having changed since, so the second to commit is refused and purged. Before,
    it replaced the first."""
    await answering(nc, names.DATASETS.list)
    files = {tag: qa_file(tmp_path / f"{tag}.jsonl", 12, tag) for tag in ("a", "b")}
    half = {tag: len(data) // 2 for tag, data in files.items()}
    ids = {tag: uuid.uuid4().hex for tag in files}

    def chunk(tag: str, seq: int) -> DatasetChunk:
        data = files[tag]
        if seq == 0:
            return DatasetChunk(upload=ids[tag], name="same", seq=0, data=data[: half[tag]], meta=DatasetUpload())
        rest = data[half[tag] :]
        return DatasetChunk(
            upload=ids[tag],
            name="same",
            seq=1,
            data=rest,
            last=True,
            sha256=hashlib.sha256(data).hexdigest(),
            size=len(data),
        )

    subject = names.dataset_upload("same", "acme")
    for tag in files:  # both begin: each passes the check at chunk 0
        assert (await send_chunk(nc, subject, chunk(tag, 0))).ok
    acks = dict(zip(files, await asyncio.gather(*(send_chunk(nc, subject, chunk(tag, 1)) for tag in files))))
    won = [tag for tag, ack in acks.items() if ack.ok]
    assert len(won) == 1, acks
    lost = acks[next(tag for tag in files if tag not in won)]
    assert not lost.retry and "a dataset named same exists" in lost.error and "--replace" in lost.error, lost
    stored = await find_dataset(nc.jetstream(), "acme/same")
    assert stored is not None and stored.sha256 == hashlib.sha256(files[won[0]]).hexdigest()
    assert await chunk_objects(nc) == 1  # the loser's chunks were purged before its refusal was sent

    # two whole puts at once, the sender's way: one is stored, the other refused (at chunk 0 or at its commit)
    results = await asyncio.gather(
        *(upload_dataset(nc, "twin", tmp_path / f"{tag}.jsonl", tenant="acme") for tag in files), return_exceptions=True
    )
    assert sorted(type(r).__name__ for r in results) == ["DatasetInfo", "Refusal"], results
    assert await chunk_objects(nc) == 2
    replaced = await upload_dataset(nc, "twin", tmp_path / "a.jsonl", DatasetUpload(replace=True), tenant="acme")
    assert replaced.sha256 == hashlib.sha256(files["a"]).hexdigest()  # --replace still replaces
    assert await chunk_objects(nc) == 2  # the replaced one's chunks are purged before the replacement is acked


async def chunk_objects(nc) -> int:
    """How many objects' chunks the datasets bucket holds (each object's chunks share one subject)."""
    info = await nc.jetstream().stream_info(
        nats_subjects.objects(names.DATASETS_BUCKET).stream, subjects_filter=DATASET_CHUNKS
    )
    return len(info.state.subjects or {})


async def test_a_refused_upload_is_sent_once(stack, nc, tmp_path):
    """The service answered no (no such job; a bad row): sending it again cannot help, so the sender does not. The
    artifact sender retried every failure, refusals too, three times over six seconds."""
    await answering(nc, names.ARTIFACTS_LIST)
    began: dict[str, set[str]] = {"artifact": set(), "dataset": set()}
    decoders = {"artifact": msgspec.msgpack.Decoder(Chunk), "dataset": msgspec.msgpack.Decoder(DatasetChunk)}

    def count(kind: str):
        async def seen(msg) -> None:
            chunk = decoders[kind].decode(msg.data)
            if chunk.seq == 0:
                began[kind].add(chunk.upload)

        return seen

    await nc.subscribe(names.artifact_upload("n1", "nosuchjob"), cb=count("artifact"))
    await nc.subscribe(names.dataset_upload("bad", "acme"), cb=count("dataset"))
    (tmp_path / "adapter.bin").write_bytes(b"x" * 4096)
    with pytest.raises(Refusal, match="no job nosuchjob"):
        await upload_file(nc, "n1", "nosuchjob", "peft", tmp_path / "adapter.bin")
    (tmp_path / "bad.jsonl").write_text('{"q": "a", "a": "b"}\n{"q": "c"}\n')
    with pytest.raises(Refusal, match="line 2"):
        await upload_dataset(nc, "bad", tmp_path / "bad.jsonl", tenant="acme")
    await nc.flush()
    await wait_for(lambda: all(began.values()), timeout=10, what="both uploads seen")
    assert {kind: len(ids) for kind, ids in began.items()} == {"artifact": 1, "dataset": 1}
