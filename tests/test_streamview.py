"""LatestView (services/streamview.py): readers that give up never reset it, a broken consumer is rebuilt, and one
group of keys (an adapter's, for the registry's `show`) is read from its index."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
from nats.js.api import KeyValueConfig
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError, ServerError
import pytest

from schemas import names, nats_subjects
from schemas.registry import AdapterVersion, Alias, NodeAdapterStatus, StoredFile, adapter_subjects
from services.aio import sleep_unless_stopped
from services.registry.store import AdapterRegistry, registry_view
from services.store_views import kv_view
from services.streamview import StaleView
from tests.conftest import retrying, wait_for

BUCKET = "streamview_test"
MANY = 20_000


def make_view(js, **options):
    """The view under test: every key of BUCKET, its value the raw bytes."""
    return kv_view(js, BUCKET, lambda _key, data: data, **options)


async def fresh_bucket(js) -> None:
    with contextlib.suppress(NotFoundError):
        await js.delete_key_value(BUCKET)
    # a busy server may still be removing the deleted stream's files
    await retrying(lambda: js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1)), ServerError)


async def put_all(js, keys: list[str], bucket: str = BUCKET, value: bytes = b"v", batch: int = 1000) -> None:
    """Write the keys concurrently, `batch` acknowledged publishes at a time."""
    for i in range(0, len(keys), batch):
        await asyncio.gather(*(js.publish(f"$KV.{bucket}.{k}", value) for k in keys[i : i + batch]))


@pytest.fixture
async def bucket(nc):
    js = nc.jetstream()
    await fresh_bucket(js)
    yield js
    with contextlib.suppress(NotFoundError):
        await js.delete_key_value(BUCKET)


@contextlib.asynccontextmanager
async def following(view):
    stop = asyncio.Event()
    task = asyncio.create_task(view.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def keys_of(view) -> set[str] | None:
    try:
        return set(await view.snapshot())
    except StaleView:
        return None


def has_keys(view, want: set[str]):
    """A predicate for wait_for: the view answers, with exactly these keys."""

    async def check() -> bool:
        return await keys_of(view) == want

    return check


async def test_readers_that_give_up_never_reset_the_view(bucket):
    """A reader's deadline shorter than the first build: readers fail (StaleView) while the build runs, but the
    view never restarts, gets to every key, and then answers every read."""
    js = bucket
    await put_all(js, [f"k{i}" for i in range(MANY)])
    view = make_view(js, catch_up_s=0.02)
    reads: list[int | str] = []
    stop_reading = asyncio.Event()

    async def reader() -> None:
        while True:
            try:
                reads.append(len(await view.snapshot()))
            except StaleView:
                reads.append("stale")
            if await sleep_unless_stopped(stop_reading, 0.1):  # the readers' pace: the canary guard's, faster
                return

    async with following(view):
        readers = [asyncio.create_task(reader()) for _ in range(3)]
        try:
            await wait_for(lambda: MANY in reads, timeout=20, what="a read with every key")
            caught_up = reads.index(MANY)
            await wait_for(lambda: len(reads) >= caught_up + 30, timeout=10, what="thirty more reads")
        finally:
            stop_reading.set()
            await asyncio.gather(*readers)
    assert "stale" in reads[:caught_up], f"the build finished within one read's deadline: {reads[:caught_up]}"
    assert view.rebuilds == 0, f"the view restarted {view.rebuilds} times under readers"
    assert all(n == MANY for n in reads[caught_up:]), reads[caught_up:]


@pytest.mark.parametrize("after", [2, 8], ids=["sequences-back", "sequences-on"])
async def test_a_view_whose_stream_is_created_again_rebuilds(bucket, after):
    """The stream deleted and created again with fewer messages (its sequences go backwards) or more (they do not,
    and the ordered consumer alone would go on from its old sequence): the view rebuilds and answers the new keys."""
    js = bucket
    await put_all(js, [f"old{i}" for i in range(5)])
    view = make_view(js, catch_up_s=1.0, heartbeat_s=0.5)
    async with following(view):
        await wait_for(has_keys(view, {f"old{i}" for i in range(5)}), timeout=10, what="the first build")
        await fresh_bucket(js)
        new = {f"new{i}" for i in range(after)}
        await put_all(js, sorted(new))
        await wait_for(has_keys(view, new), timeout=15, what=f"the view of the new stream: {sorted(new)}")
        assert view.rebuilds >= 1


@pytest.mark.parametrize("library_heals", [True, False], ids=["nats-py-resets-it", "the-view-rebuilds-it"])
async def test_a_deleted_consumer_is_followed_again(bucket, monkeypatch, library_heals):
    """The view's consumer deleted on the server, so its heartbeats stop: nats-py's ordered consumer makes a new
    one itself; where it does not, the view sees that it stopped moving while the stream holds newer messages, and
    rebuilds. Either way the view follows the stream again."""
    js = bucket
    if not library_heals:

        async def no_reset(_jsi, _sequence) -> bool:
            return False

        monkeypatch.setattr(JetStreamContext._JSI, "reset_ordered_consumer", no_reset)
    await put_all(js, ["a", "b"])
    view = make_view(js, catch_up_s=1.0, heartbeat_s=0.5)
    async with following(view):
        await wait_for(has_keys(view, {"a", "b"}), timeout=10, what="the first build")
        stream = nats_subjects.kv(BUCKET).stream
        for consumer in await js.consumers_info(stream):
            await js.delete_consumer(stream, consumer.name)
        await put_all(js, ["c"])
        await wait_for(has_keys(view, {"a", "b", "c"}), timeout=15, what="the key written after")
    if not library_heals:
        assert view.rebuilds == 1


def _version(name: str, n: int) -> AdapterVersion:
    peft = StoredFile(name="adapter.tar.gz", sha256="0" * 64, size=1)
    return AdapterVersion(
        name=name, version=n, job=f"j-{name}", base_model="tiny", peft=peft, r=8, alpha=16, target_modules=["q_proj"]
    )


async def test_show_reads_one_adapter_from_its_group(nc):
    """`show NAME` among many adapters is read from the view's index of NAME's keys, never a walk of all keys;
    a removed key leaves the index, and an adapter with no key left has no group."""
    js = nc.jetstream()
    kv = await js.key_value(names.ADAPTERS_KV)
    enc = msgspec.json.encode
    writes: dict[str, bytes] = {}
    for i in range(300):
        name = f"a{i}"
        writes[names.adapter_alias_key(name)] = enc(Alias(name=name, current=2, history=[1], latest=2))
        for n in (1, 2):
            writes[names.adapter_version_key(name, n)] = enc(_version(name, n))
        for node in ("n1", "n2"):
            status = NodeAdapterStatus(name=name, version=2, node=node, engine="vllm", state="loaded", updated=1.0)
            writes[names.adapter_node_key(name, node)] = enc(status)
    for i in range(0, len(writes), 500):
        await asyncio.gather(*(kv.put(k, v) for k, v in list(writes.items())[i : i + 500]))
    await kv.delete(names.adapter_node_key("a7", "n1"))
    for key in [k for k in writes if k.split(".")[1] == "a8"]:
        await kv.delete(key)

    view = registry_view(js)
    registry = AdapterRegistry(kv, view)
    async with following(view):
        await wait_for(lambda: registry.adapters(), timeout=15, what="the first build")
        assert len(await registry.adapters()) == 299

        async def walk():
            raise AssertionError("show walked every key of the registry")

        view.snapshot = walk  # a show must not read the whole view
        reply = (await registry.adapters(only="a7"))["a7"]
        assert reply.alias.name == "a7" and reply.alias.current == 2
        assert [v.version for v in reply.versions] == [1, 2]
        assert [s.node for s in reply.nodes] == ["n2"]
        group = await view.snapshot_group("a7")
        assert sorted(group) == ["alias.a7", "node.a7.n2", "version.a7.1", "version.a7.2"]
        assert await view.snapshot_group("a8") == {}
        assert await registry.adapters(only="a8") == {}
        assert await registry.adapters(only="nobody") == {}

        # a group read waits for the newest message of the group's own subjects: a change made before it is in it
        revision = await kv.put(names.adapter_version_key("a7", 3), enc(_version("a7", 3)))
        newest = [
            (await js.get_msg(nats_subjects.kv(names.ADAPTERS_KV).stream, subject=s)).seq
            for s in adapter_subjects("a7")
        ]
        assert max(newest) == revision
        assert [v.version for v in (await registry.adapters(only="a7"))["a7"].versions] == [1, 2, 3]
