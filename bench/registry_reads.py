"""Registry reads at 10 and 1,000 adapters: `show` and `list` answered by the registry service from its one
long-lived view, against the watcher-per-read the service used before (a KV watcher for the versions and one for
the node statuses of each adapter), measured in alternating rounds on one embedded nats-server.
Run by hand:  python bench/registry_reads.py [--adapters 10 1000 --rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import nats  # noqa: E402
from nats.js.errors import NoKeysError  # noqa: E402

from bench.guarantees import Guarantees  # noqa: E402
from schemas import names, nats_subjects  # noqa: E402
from schemas.registry import (  # noqa: E402
    AdapterList,
    AdapterListQuery,
    AdapterQuery,
    AdapterReply,
    AdapterVersion,
    Alias,
    StoredFile,
)
from services import bus  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402
from services.registry.service import RegistryService  # noqa: E402
from services.registry.store import AdapterRegistry  # noqa: E402

_alias = msgspec.json.Decoder(Alias)


async def watcher_read(kv, pattern: str) -> int:
    """The old read: a watcher (an ephemeral consumer) per call. The old service left it to expire on the server
    (300 s), which reached the server's consumer limit after about a thousand reads; here it is deleted at once, so
    that the side can be measured at all."""
    try:
        watcher = await kv.watch(pattern, ignore_deletes=True)
    except NoKeysError:
        return 0
    found = 0
    try:
        while (entry := await watcher.updates(timeout=5.0)) is not None:
            found += bool(entry.value)
    finally:
        consumer = watcher._sub._consumer
        await watcher.stop()
        await kv._js.delete_consumer(nats_subjects.kv(names.ADAPTERS_KV).stream, consumer)
    return found


async def old_show(kv, name: str) -> None:
    await kv.get(names.adapter_alias_key(name))
    await watcher_read(kv, names.adapter_version_key(name, "*"))
    await watcher_read(kv, names.adapter_node_key(name, "*"))


async def old_list(kv, count: int) -> None:
    await watcher_read(kv, names.adapter_alias_key())
    for i in range(count):
        await watcher_read(kv, names.adapter_version_key(f"a{i}", "*"))
        await watcher_read(kv, names.adapter_node_key(f"a{i}", "*"))


async def timed(make, repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        await make()
    return (time.perf_counter() - t0) / repeat * 1000


async def measure(count: int, rounds: int) -> int:
    with EmbeddedNats() as server:
        nc = await nats.connect(server.url)
        await bus.ensure_resources(nc)
        kv = await nc.jetstream().key_value(names.ADAPTERS_KV)
        registry = AdapterRegistry(kv)
        for i in range(count):
            await registry.add_version(
                AdapterVersion(
                    name=f"a{i}",
                    version=1,
                    job=f"j{i}",
                    base_model="tiny",
                    r=8,
                    alpha=16,
                    peft=StoredFile(name="p", sha256="0" * 64, size=1),
                    target_modules=["q_proj"],
                )
            )
        service_nc = await nats.connect(server.url)
        stop = asyncio.Event()
        task = asyncio.create_task(RegistryService(service_nc).run(stop))
        await bus.request(nc, names.ADAPTERS.list, AdapterListQuery(), AdapterList, timeout=30)
        list_repeat = 5 if count > 100 else 50
        sides = {
            "show, view": lambda: bus.request(nc, names.ADAPTERS.show, AdapterQuery(name="a0"), AdapterReply),
            "show, watchers": lambda: old_show(kv, "a0"),
            "list, view": lambda: bus.request(nc, names.ADAPTERS.list, AdapterListQuery(), AdapterList, timeout=60),
            "list, watchers": lambda: old_list(kv, count),
        }
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(rounds):  # alternate the sides in short rounds
            for label, make in sides.items():
                times[label].append(await timed(make, list_repeat if label.startswith("list") else 50))
        info = await nc.jetstream().stream_info(nats_subjects.kv(names.ADAPTERS_KV).stream)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{count:>5} adapters: show {med['show, view']:.2f} ms (view) vs {med['show, watchers']:.2f} ms "
            f"(watchers), {med['show, watchers'] / med['show, view']:.1f}x; list {med['list, view']:.1f} ms vs "
            f"{med['list, watchers']:.1f} ms, {med['list, watchers'] / med['list, view']:.1f}x; consumers on the "
            f"bucket after every read: {info.state.consumer_count} (the registry's view)"
        )
        stop.set()
        await task
        await service_nc.close()
        await nc.close()
        return info.state.consumer_count


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    promises = Guarantees()
    for count in args.adapters:
        consumers = await measure(count, args.rounds)
        promises.check(
            consumers <= 1, f"{count} adapters: one consumer left on the bucket (the registry's view), not {consumers}"
        )
    return promises.verdict()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
