"""Chunked uploads into the object store through the real artifact service: whole, verified, never half-written."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import tarfile
import time

import msgspec
import pytest

from schemas import names, nats_subjects
from schemas.artifacts import ArtifactMeta, Chunk, ChunkAck
from services.transfer.download import DownloadError, download, safe_extract, sha256_file
from services.transfer.sender import upload_file
from services.artifacts.service import ArtifactService
from tests.conftest import ROOT, answering, object_names, random_file, running_on, wait_for

_ack = msgspec.json.Decoder(ChunkAck)


@pytest.fixture
async def artifact_service(services):
    svc, *_ = await services.start(lambda c: ArtifactService(c, stall_timeout=1.0))
    await asyncio.wait_for(svc.ready.wait(), 10)
    await running_on(svc.nc, "j1")  # the job the chunks below belong to, running on n1
    return svc


async def bucket_messages(nc) -> int:
    info = await nc.jetstream().stream_info(nats_subjects.objects(names.ARTIFACTS_BUCKET).stream)
    return info.state.messages


async def _purged(nc) -> bool:
    return await bucket_messages(nc) == 0


async def send(nc, chunk: Chunk) -> ChunkAck:
    msg = await nc.request(names.artifact_upload("n1", chunk.job), msgspec.msgpack.encode(chunk), timeout=10)
    return _ack.decode(msg.data)


async def in_order(nc, chunks: list[Chunk]) -> list[ChunkAck]:
    """Send chunks in this order without waiting between them, as a windowed sender does."""
    tasks = []
    for chunk in chunks:
        tasks.append(asyncio.create_task(send(nc, chunk)))
        await asyncio.sleep(0.01)
    return await asyncio.gather(*tasks)


def chunks_of(data: bytes, size: int, upload="u1", job="j1", kind="peft", sha=None) -> list[Chunk]:
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    out = []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(
            Chunk(
                upload=upload,
                job=job,
                kind=kind,
                seq=i,
                data=p,
                last=last,
                sha256=(sha or hashlib.sha256(data).hexdigest()) if last else "",
                size=len(data) if last else 0,
                meta=ArtifactMeta(base_model="tiny", attempt=1) if i == 0 else None,
            )
        )
    return out


async def test_a_50_mb_round_trip_is_byte_exact(nc, artifact_service, tmp_path):
    src = random_file(tmp_path / "a.bin", 50)
    await running_on(nc, "job50")
    info = await upload_file(nc, "n1", "job50", "peft", src, ArtifactMeta(base_model="tiny", summary="r=8"))
    assert info.size == 50 << 20 and info.sha256 == sha256_file(src) and info.name == "job50/peft"
    got = await download(nc, "job50", "peft", tmp_path / "b.bin")
    assert got.sha256 == info.sha256 and sha256_file(tmp_path / "b.bin") == info.sha256
    assert got.base_model == "tiny" and got.summary == "r=8"


async def test_duplicate_and_out_of_order_chunks_still_make_one_whole_object(nc, artifact_service):
    data = os.urandom(10_000)
    c = chunks_of(data, 2_000)
    acks = await in_order(nc, [c[0], c[2], c[1], c[1], c[0], c[3], c[4]])
    assert all(a.ok for a in acks), acks
    last = acks[-1]
    assert last.ok and last.stored and last.stored.size == len(data)
    obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    assert (await obs.get("j1/peft")).data == data


async def test_a_missing_chunk_fails_the_upload_and_leaves_nothing(nc, artifact_service):
    c = chunks_of(os.urandom(10_000), 2_000)
    first, held, ack = await in_order(nc, [c[0], c[2], msgspec.structs.replace(c[4], seq=40)])
    assert first.ok and not held.ok  # chunk 2 waited for chunk 1, then failed with the upload
    assert not ack.ok and "chunk 1 never arrived" in ack.error
    assert await object_names(nc) == [] and await bucket_messages(nc) == 0


async def test_a_corrupted_chunk_fails_the_checksum_and_leaves_nothing(nc, artifact_service):
    data = os.urandom(10_000)
    c = chunks_of(data, 5_000)
    bad = msgspec.structs.replace(c[1], data=bytes([c[1].data[0] ^ 0xFF]) + c[1].data[1:])  # always a change
    assert (await send(nc, c[0])).ok
    ack = await send(nc, bad)
    assert not ack.ok and "checksum mismatch" in ack.error
    assert await object_names(nc) == [] and await bucket_messages(nc) == 0


async def test_a_sender_that_goes_away_leaves_no_object(nc, artifact_service):
    c = chunks_of(os.urandom(10_000), 2_000)
    for chunk in c[:3]:
        assert (await send(nc, chunk)).ok
    await wait_for(lambda: not artifact_service.uploads, timeout=5, what="the stalled upload to end")
    ack = await send(nc, c[3])
    assert not ack.ok and "stalled" in ack.error
    assert await object_names(nc) == [] and await bucket_messages(nc) == 0


async def test_a_killed_sender_process_leaves_no_object(nc, artifact_service, nats_server, tmp_path):
    src = random_file(tmp_path / "big.bin", 40)
    code = (
        f"import asyncio, nats\nfrom services.transfer.sender import upload_file\n"
        f"async def m():\n nc = await nats.connect('{nats_server.url}')\n"
        f" await upload_file(nc, 'n1', 'killed', 'peft', '{src}', window=1)\nasyncio.run(m())\n"
    )
    await running_on(nc, "killed")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    await wait_for(lambda: bool(artifact_service.uploads), timeout=30, what="the upload to start")
    proc.kill()
    proc.wait()
    await wait_for(lambda: not artifact_service.uploads, timeout=5, what="the upload to be dropped")
    assert await object_names(nc) == []
    await wait_for(lambda: _purged(nc), timeout=10, what="the dropped upload's chunks to be purged")


async def test_names_from_the_wire_are_never_paths(nc, artifact_service, tmp_path):
    bad = {"upload": "u", "job": "../../etc", "kind": "peft", "seq": 0, "data": b"x", "last": True}
    msg = await nc.request(names.artifact_upload("n1", "x"), msgspec.msgpack.encode(bad), timeout=5)
    ack = _ack.decode(msg.data)
    assert not ack.ok and "job" in ack.error
    with pytest.raises(ValueError):
        await download(nc, "../x", "peft", tmp_path / "o")
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        (tmp_path / "f").write_text("x")
        tar.add(tmp_path / "f", arcname="../../escaped")
    with pytest.raises(DownloadError, match="outside the target directory"):
        safe_extract(evil, tmp_path / "out")
    assert not (tmp_path.parent / "escaped").exists()


async def test_list_and_delete_through_the_service(nc, artifact_service, tmp_path):
    from schemas.artifacts import ArtifactList, ArtifactQuery, Deleted
    from services import bus

    src = random_file(tmp_path / "a.bin", 1)
    for job in ("jobA", "jobB"):
        await running_on(nc, job)
    await upload_file(nc, "n1", "jobA", "peft", src)
    await upload_file(nc, "n1", "jobA", "gguf", src)
    await upload_file(nc, "n1", "jobB", "peft", src)
    listed = await bus.request(nc, names.ARTIFACTS_LIST, ArtifactQuery(job="jobA"), ArtifactList)
    assert sorted(a.name for a in listed.artifacts) == ["jobA/gguf", "jobA/peft"]
    gone = await bus.request(nc, names.ARTIFACTS_DELETE, ArtifactQuery(job="jobA"), Deleted)
    assert sorted(gone.names) == ["jobA/gguf", "jobA/peft"]
    assert await object_names(nc) == ["jobB/peft"]


async def test_a_1_gb_artifact_keeps_the_service_small(nc, nats_server, tmp_path):
    """The service in its own process, so its peak RSS is its own."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "artifacts", "--nats", nats_server.url],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        src = random_file(tmp_path / "g.bin", 1024)
        await answering(nc, names.ARTIFACTS_LIST)  # its process is up
        t0 = time.monotonic()
        await running_on(nc, "big")
        info = await upload_file(nc, "n1", "big", "peft", src, timeout=30)
        took = time.monotonic() - t0
        with open(f"/proc/{proc.pid}/status") as f:
            hwm_mib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
        print(f"1 GiB through the artifact service: {1024 / took:.0f} MiB/s, service peak RSS {hwm_mib:.0f} MiB")
        assert info.size == 1 << 30 and info.sha256 == sha256_file(src)
        assert hwm_mib < 200, hwm_mib
    finally:
        proc.terminate()
        proc.wait(10)


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


async def test_chunks_flooded_ahead_of_a_gap_are_refused_and_their_memory_given_back(nc, nats_server):
    """Two uploads send 24 chunks of 4 MiB each after a chunk that never comes: the service holds at most its
    per-upload limit out of order, refuses the rest naming the limit, and its memory falls back afterwards. The
    service is stalled through most of the first flood, as a busy machine stalls it: 72 MiB wait for it at the
    server, which keeps it connected (it had cut it off as a slow consumer at its default 64 MiB)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "artifacts", "--nats", nats_server.url],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await answering(nc, names.ARTIFACTS_LIST)
        before = _rss_mib(proc.pid)
        piece = os.urandom(4 << 20)
        replies = await nc.subscribe(nc.new_inbox() + ".flood")
        for upload in ("f1", "f2"):
            await running_on(nc, upload)
            first = Chunk(upload=upload, job=upload, kind="peft", seq=0, data=b"x", meta=ArtifactMeta(attempt=1))
            assert (await send_as(nc, "n1", first)).ok
            if upload == "f1":
                os.kill(proc.pid, signal.SIGSTOP)
            for seq in range(2, 26):  # chunk 1 never comes; each sent as soon as the server has the one before
                if upload == "f1" and seq == 20:
                    os.kill(proc.pid, signal.SIGCONT)
                chunk = Chunk(upload=upload, job=upload, kind="peft", seq=seq, data=piece)
                await nc.publish(
                    names.artifact_upload("n1", upload), msgspec.msgpack.encode(chunk), reply=replies.subject
                )
                await nc.flush()
        acks = [_ack.decode((await replies.next_msg(timeout=60)).data) for _ in range(48)]
        await replies.unsubscribe()
        during = _rss_mib(proc.pid, "VmHWM")
        refused = [a for a in acks if not a.ok]
        assert len(refused) == len(acks)  # the first refusal answers the chunks it held, too
        assert any("64 MiB one upload may hold out of order" in a.error for a in refused), refused[0].error
        await wait_for(lambda: _rss_mib(proc.pid) < before + 80, timeout=20, what="the service's memory to fall back")
        after = _rss_mib(proc.pid)
        print(
            f"artifact service RSS: {before:.0f} MiB before, peak {during:.0f} MiB, {after:.0f} MiB after "
            f"(48 x 4 MiB flooded)"
        )
        assert during < before + 150, (before, during)  # 192 MiB were sent: at most the limit was held
        assert await object_names(nc) == []
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(10)


async def send_as(nc, node: str, chunk: Chunk, timeout: float = 10) -> ChunkAck:
    msg = await nc.request(names.artifact_upload(node, chunk.job), msgspec.msgpack.encode(chunk), timeout=timeout)
    return _ack.decode(msg.data)


async def test_an_upload_whose_attempt_was_superseded_meanwhile_is_refused_at_commit(nc, artifact_service):
    """Attempt 1's upload opens while it is the job's; the job moves to attempt 2 on another node before its last
    chunk (a stalled node resuming within the stall timeout): the commit is refused and nothing is stored."""
    c = chunks_of(os.urandom(10_000), 2_000)
    acks = await in_order(nc, c[:-1])
    assert all(a.ok for a in acks), acks
    await running_on(nc, "j1", node="n2", attempt=2)  # the scheduler placed it again meanwhile
    last = await send(nc, c[-1])
    assert not last.ok and "attempt 2 on n2" in last.error, last
    await wait_for(lambda: _purged(nc), timeout=10, what="the upload's chunks purged")
    assert "j1/peft" not in await object_names(nc)
