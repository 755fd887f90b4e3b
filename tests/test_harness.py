"""The fault-injection harness itself (tests/harness), against real nats-servers and real service processes."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import nats
import pytest
from nats.js.api import KeyValueConfig, ObjectStoreConfig
from nats.js.errors import KeyNotFoundError, NotFoundError

from schemas import names
from schemas.jobs import Accepted
from tests.conftest import answering, submit, wait_for, wait_nodes, wait_state
from tests.harness import NatsProxy, Stack
from tests.harness.protocol import Splitter, strip_connect_urls
from tests.harness.stack import cluster_servers
from tests.qa import pairs

BUCKET = "harness_kv"
OBJECTS = "harness_obs"


@pytest.fixture
async def proxy(nats_server):
    p = NatsProxy(nats_server.url).start()
    yield p
    p.close()


@pytest.fixture
async def direct(nats_server):
    """The test's own connection, straight to the server; a responder on `echo` and an empty KV bucket."""
    nc = await nats.connect(nats_server.url)

    async def echo(msg):
        await msg.respond(b"re:" + msg.data)

    await nc.subscribe("echo", cb=echo)
    js = nc.jetstream()
    for delete in (js.delete_key_value, js.delete_object_store):
        for bucket in (BUCKET, OBJECTS):
            try:
                await delete(bucket)
            except NotFoundError:
                pass
    await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=10))
    yield nc
    await nc.close()


class Watched:
    """A connection through the proxy that records its disconnects and reconnects."""

    def __init__(self):
        self.disconnects = 0
        self.reconnected = asyncio.Event()

    async def connect(self, url: str) -> nats.NATS:
        async def on_disconnect():
            self.disconnects += 1

        async def on_reconnect():
            self.reconnected.set()

        return await nats.connect(
            url,
            reconnect_time_wait=0.1,
            max_reconnect_attempts=-1,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )


async def replies(nc, data: bytes = b"x", timeout: float = 0.3) -> bool:
    try:
        return (await nc.request("echo", data, timeout=timeout)).data == b"re:" + data
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return False


async def collect(nc, subject: str) -> list[bytes]:
    """The payloads of what arrives on `subject`, in order, from now on."""
    got: list[bytes] = []

    async def keep(msg):
        got.append(msg.data)

    await nc.subscribe(subject, cb=keep)
    await nc.flush()
    return got


def test_splitter_takes_frames_apart_whatever_the_chunks():
    stream = (
        b'INFO {"server_id":"x","connect_urls":["10.0.0.1:4222"],"ws_connect_urls":["10.0.0.1:80"]}\r\n'
        b"MSG a 1 5\r\nhello\r\nPING\r\nHMSG b 2 r 12 14\r\nNATS/1.0\r\n\r\nhi\r\n+OK\r\n"
    )
    for size in (1, 3, 7, len(stream)):
        splitter = Splitter(rewrite=strip_connect_urls)
        out = b"".join(splitter.feed(stream[i : i + size])[0] for i in range(0, len(stream), size))
        assert out == b'INFO {"server_id":"x"}\r\n' + stream[stream.index(b"MSG") :]
    held_back = []
    upstream = Splitter(classify=lambda op, subject: "hold" if subject.startswith(b"$KV.") else None)
    sent = b"PUB $KV.b.k 1\r\n1\r\nPUB p 2\r\nab\r\nHPUB $KV.b.k _INBOX.1 12 13\r\nNATS/1.0\r\n\r\n2\r\nPING\r\n"
    passed = b""
    for byte in range(len(sent)):
        out, held = upstream.feed(sent[byte : byte + 1])
        passed += out
        held_back += held
    assert passed == b"PUB p 2\r\nab\r\nPING\r\n"
    assert [frame for _, frame in held_back] == [
        b"PUB $KV.b.k 1\r\n1\r\n",
        b"HPUB $KV.b.k _INBOX.1 12 13\r\nNATS/1.0\r\n\r\n2\r\n",
    ]


async def test_core_requests_pass_and_a_blackhole_holds_bytes_without_closing_anything(proxy, direct):
    w = Watched()
    nc = await w.connect(proxy.url)
    try:
        assert await replies(nc)
        got = await collect(direct, "seq")
        await direct.flush()
        proxy.blackhole(1.0)
        t0 = time.monotonic()
        assert not await replies(nc, timeout=0.3)
        for i in range(5):
            await nc.publish("seq", str(i).encode())
        await nc.flush(timeout=5)  # answered only once healed
        assert time.monotonic() - t0 >= 0.9
        await wait_for(lambda: len(got) == 5, timeout=5, what="what was held, delivered")
        assert got == [b"0", b"1", b"2", b"3", b"4"]
        assert await replies(nc)
        assert nc.stats["reconnects"] == 0 and w.disconnects == 0
        assert proxy.stats["accepted"] == 1
    finally:
        await nc.close()


async def test_cut_resets_the_connection_and_the_client_comes_back_through_the_proxy(proxy, direct):
    w = Watched()
    nc = await w.connect(proxy.url)
    try:
        assert await replies(nc)
        assert proxy.cut() == 1
        await asyncio.wait_for(w.reconnected.wait(), 10)
        await wait_for(lambda: replies(nc), timeout=10, what="replies after the reconnect")
        assert nc.stats["reconnects"] >= 1 and proxy.stats["accepted"] >= 2
    finally:
        await nc.close()


async def test_dropped_jetstream_writes_time_out_while_core_requests_are_answered(proxy, direct):
    nc = await nats.connect(proxy.url)
    try:
        kv = await nc.jetstream(timeout=0.5).key_value(BUCKET)
        proxy.hold_writes(mode="drop")
        with pytest.raises(nats.errors.TimeoutError):
            await kv.put("k", b"lost")
        assert await replies(nc)
        assert proxy.stats["dropped"] == 1
        with pytest.raises(KeyNotFoundError):
            await (await direct.jetstream().key_value(BUCKET)).get("k")
        proxy.release_writes()
        await kv.put("k", b"kept")
        assert (await (await direct.jetstream().key_value(BUCKET)).get("k")).value == b"kept"
    finally:
        await nc.close()


async def test_delayed_writes_land_late_in_their_order_while_other_frames_flow(proxy, direct):
    nc = await nats.connect(proxy.url)
    mine = await direct.jetstream().key_value(BUCKET)
    plain = await collect(direct, "plain")
    try:
        proxy.hold_writes(prefixes=(f"$KV.{BUCKET}.",), mode="delay", delay_s=1.0)
        t0 = time.monotonic()
        for i in range(3):
            await nc.publish(f"$KV.{BUCKET}.k", str(i).encode())
            await nc.publish("plain", str(i).encode())
        await wait_for(lambda: len(plain) == 3, timeout=5, what="the frames not held")
        assert plain == [b"0", b"1", b"2"] and proxy.stats["delayed"] == 3
        with pytest.raises(KeyNotFoundError):
            await mine.get("k")  # not there yet

        async def landed():
            try:
                return (await mine.get("k")).value == b"2"
            except KeyNotFoundError:
                return False

        await wait_for(landed, timeout=10, what="the delayed writes")
        assert time.monotonic() - t0 >= 0.9
        assert [e.value for e in await mine.history("k")] == [b"0", b"1", b"2"]
    finally:
        await nc.close()


async def test_info_reaches_the_client_without_the_servers_addresses(tmp_path):
    servers = cluster_servers(tmp_path, size=2)
    servers[0].start()
    proxy = NatsProxy(servers[0].url).start()
    conns = []
    try:
        nc = await nats.connect(servers[0].url)
        early = await nats.connect(proxy.url)  # hears of the second server by an INFO sent later
        conns += [nc, early]
        servers[1].start()
        await wait_for(lambda: len(nc._server_pool) == 2, what="the direct client told of the second server")
        await early.flush()  # what the server sent it before this PONG has arrived
        late = await nats.connect(proxy.url)  # told in its first INFO
        fresh = await nats.connect(servers[0].url)
        conns += [late, fresh]
        assert fresh._server_info.get("connect_urls")  # what the server says, and the proxy takes out
        assert "connect_urls" not in late._server_info
        for client in (early, late):
            assert [s.uri.port for s in client._server_pool] == [proxy.port]
    finally:
        for conn in conns:
            await conn.close()
        proxy.close()
        for s in servers:
            s.stop()


async def test_a_20_mb_object_goes_through_the_proxy(proxy, direct):
    nc = await nats.connect(proxy.url)
    try:
        data = os.urandom(20 << 20)
        store = await nc.jetstream().create_object_store(OBJECTS, ObjectStoreConfig(bucket=OBJECTS))
        t0 = time.monotonic()
        await store.put("blob", data)
        took = time.monotonic() - t0
        back = await (await direct.jetstream().object_store(OBJECTS)).get("blob")
        assert hashlib.sha256(back.data).digest() == hashlib.sha256(data).digest()
        print(f"20 MiB put through the proxy in {took:.2f}s ({20 / took:.0f} MiB/s)")
    finally:
        await nc.close()


async def test_a_stack_runs_a_job_and_stalls_an_agent(tmp_path):
    async with Stack(tmp_path) as stack:
        stack.start_scheduler("sched")
        stack.start_artifacts("arts")
        stack.start_agent("n1", gpus="4096", hold_s=0.5)
        nc = await nats.connect(stack.client_url)
        try:
            await answering(nc, names.LIST_JOBS)
            await wait_nodes(nc, 1, timeout=30)
            reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2)})
            assert isinstance(reply, Accepted), reply
            job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=30)
            assert job.state == "succeeded", (job.message, stack.log("n1")[-2000:])

            # stopped for 3 s: this process sees the 'T' only while it lasts, and a busy machine can keep it from
            # looking for a second
            stall = stack.stall("n1", 3.0)
            await wait_for(lambda: stack.state("n1") == "T", timeout=3, what="the agent stopped")
            await stall.wait_async()
            await wait_for(lambda: stack.state("n1") not in ("T", None), timeout=5, what="the agent continued")
            assert stack.proxy("n1").stats["accepted"] >= 1
            stack.kill("arts")
            assert stack.state("arts") is None
            stack.restart("arts")
            await answering(nc, names.ARTIFACTS_LIST)
        finally:
            await nc.close()


async def test_a_clustered_stack_has_3_replicas_and_partitions_one_process(tmp_path):
    async with Stack(tmp_path, cluster=True) as stack:
        stack.start_scheduler("sched")
        nc = await nats.connect(servers=stack.client_url.split(","))
        try:
            assert (await nc.jetstream().stream_info(names.JOBS_STREAM)).config.num_replicas == 3
            await answering(nc, names.LIST_JOBS)
            stack.blackhole("sched", 1.0)
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request(names.LIST_JOBS, b"{}", timeout=0.3)
            await answering(nc, names.LIST_JOBS)
            assert stack.proxy("sched").stats["accepted"] == 1  # the same connection, held then healed
        finally:
            await nc.close()
