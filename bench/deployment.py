"""One promote reaching a fleet: 200 simulated serving nodes, each the real agent's deployment logic (watch the
registry, fetch the artifact once, check its sha256, unpack and place it, report), with a vLLM filesystem-resolver
engine without an address (placing the directory is all it does: the node reports `placed`) in a temporary
directory. Measured against one node alone in the same run, sides alternating. Each round registers a new version
(nodes stage it: fetch it before it is promoted; the time until all have is printed), then promotes it; with
`--no-staging` the promotion fetches it.

All 200 nodes share this machine's one nats-server, one Python process and one disk, which a fleet does not: the
fetching rounds move 200 x the artifact through the server and write 200 x its unpacked bytes to one disk, so they
measure this machine's bytes per second more than the agent; the rounds with the artifact cached measure the agent.

    .venv/bin/python bench/deployment.py [--nodes 200] [--rounds 4] [--artifact-mib 4] [--no-staging]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import nats  # noqa: E402

from schemas import names  # noqa: E402
from schemas.registry import AdapterVersion, NodeAdapterStatus, PromoteRequest, StoredFile  # noqa: E402
from services import bus  # noqa: E402
from services.agent.engines import Engine  # noqa: E402
from services.agent.deployment import Deployment  # noqa: E402
from services.transfer.sender import upload_file  # noqa: E402
from tests.conftest import running_on  # noqa: E402
from services.artifacts.service import ArtifactService  # noqa: E402
from services.embedded import EmbeddedNats  # noqa: E402
from services.registry.service import RegistryService  # noqa: E402
from services.registry.store import AdapterRegistry  # noqa: E402

_status = msgspec.json.Decoder(NodeAdapterStatus)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def adapter_tar(path: Path, mib: int) -> Path:
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, data in (
            ("adapter_config.json", b'{"r": 16, "lora_alpha": 32}'),
            ("adapter_model.safetensors", os.urandom(mib * 2**20)),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


class Nodes:
    """n simulated serving nodes: a connection and a Deployment each."""

    def __init__(self, url: str, prefix: str, n: int, tmp: Path, stage: bool) -> None:
        self.url, self.names, self.tmp, self.stage = url, [f"{prefix}{i:03d}" for i in range(n)], tmp, stage
        self.adapter = self.model = prefix  # each side its own base model: neither loads the other's adapter
        self.loaded: dict[str, float] = {}

    async def start(self, stop: asyncio.Event) -> None:
        self.conns, self.deployments = [], []
        for node in self.names:
            nc = await nats.connect(self.url)
            engine = Engine("vllm-dir", self.model, directory=self.tmp / node / "engine")
            self.conns.append(nc)
            self.deployments.append(Deployment(nc, node, [engine], self.tmp / node, stage=self.stage))
        self.tasks = [asyncio.create_task(r.run(stop)) for r in self.deployments]
        await asyncio.gather(*(r.ready.wait() for r in self.deployments))

    async def staged(self, before: list[int], since: float) -> list[float]:
        """Until every node has staged one more version than `before` counts: each node's time to it."""
        done: dict[int, float] = {}
        while len(done) < len(self.deployments):
            for i, r in enumerate(self.deployments):
                if i not in done and r.stager.staged > before[i]:
                    done[i] = time.monotonic() - since
            await asyncio.sleep(0.005)
            if time.monotonic() - since > 120:
                raise SystemExit(f"only {len(done)} of {len(self.names)} nodes staged within 120 s")
        return list(done.values())

    def fetched_bytes(self) -> int:
        return sum(
            p.stat().st_size
            for node in self.names
            for p in (self.tmp / node / "adapters").rglob("*")
            if p.is_file() and p.name != "loaded.json"
        )


async def promote_and_wait(nc, nodes: Nodes, version: int, listen) -> list[float]:
    nodes.loaded.clear()
    listen.target = (nodes, version)
    t0 = time.monotonic()
    await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name=nodes.adapter, version=version), msgspec.Raw)
    while len(nodes.loaded) < len(nodes.names):
        await asyncio.sleep(0.01)
        if time.monotonic() - t0 > 120:
            raise SystemExit(f"only {len(nodes.loaded)} of {len(nodes.names)} nodes loaded within 120 s")
    return [t - t0 for t in nodes.loaded.values()]


class Listener:
    target: tuple[Nodes, int] | None = None

    async def on_status(self, msg) -> None:
        s = _status.decode(msg.data)
        if (
            self.target
            and s.state in ("loaded", "placed")
            and s.name == self.target[0].adapter
            and s.version == self.target[1]
            and s.node in self.target[0].names
        ):
            self.target[0].loaded.setdefault(s.node, time.monotonic())


async def main(args) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="jetlora-bench-deployment-"))
    server = EmbeddedNats(store_dir=tmp / "nats", websocket=False).start()
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    try:
        nc = await nats.connect(server.url)
        await bus.ensure_resources(nc)
        service_conns = [await nats.connect(server.url) for _ in range(2)]
        tasks += [
            asyncio.create_task(ArtifactService(service_conns[0]).run(stop)),
            asyncio.create_task(RegistryService(service_conns[1]).run(stop)),
        ]
        await asyncio.sleep(0.5)  # the services subscribe
        registry = AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))
        stage = not args.no_staging
        fleet, alone = Nodes(server.url, "node", args.nodes, tmp, stage), Nodes(server.url, "solo", 1, tmp, stage)

        async def register(side: Nodes, v: int) -> None:
            job = f"{side.adapter}{v}"
            await running_on(nc, job)
            info = await upload_file(nc, "n1", job, "peft", adapter_tar(tmp / f"{job}.tar.gz", args.artifact_mib))
            await registry.add_version(
                AdapterVersion(
                    name=side.adapter,
                    version=v,
                    job=job,
                    base_model=side.model,
                    r=16,
                    alpha=32,
                    target_modules=["q_proj", "v_proj"],
                    peft=StoredFile(name=info.name, sha256=info.sha256, size=info.size),
                )
            )

        listen = Listener()
        await nc.subscribe(names.adapter_status(), cb=listen.on_status)
        await fleet.start(stop)
        await alone.start(stop)
        tasks += fleet.tasks + alone.tasks
        for side in (alone, fleet):  # a first version that every node serves (fetched at its promotion)
            await register(side, 1)
            first = await promote_and_wait(nc, side, 1, listen)  # the fleet's, last
        size = (tmp / "node1.tar.gz").stat().st_size
        print(
            f"{args.nodes} nodes, artifacts of {size / 2**20:.1f} MiB, {args.rounds} rounds, "
            f"{'staged when registered' if stage else 'fetched when promoted (--no-staging)'}"
        )
        print(
            f"  the first promote (fetching it): p50 {statistics.median(first) * 1000:.0f} ms, "
            f"p99 {pct(first, 99) * 1000:.0f} ms"
        )
        fleet_p50, fleet_p99, solo, staging_p99 = [], [], [], []
        for r in range(args.rounds):
            version = 2 + r
            for side in (fleet, alone) if r % 2 == 0 else (alone, fleet):
                before, t0 = [n.stager.staged if n.stager else 0 for n in side.deployments], time.monotonic()
                await register(side, version)
                staged = await side.staged(before, t0) if stage else []
                times = await promote_and_wait(nc, side, version, listen)
                if side is fleet:
                    fleet_p50.append(statistics.median(times))
                    fleet_p99.append(pct(times, 99))
                    staging_p99.extend([pct(staged, 99)] if staged else [])
                    said = f" (staged in p99 {staging_p99[-1] * 1000:.0f} ms after registering)" if staged else ""
                    print(
                        f"  round {r + 1}: promote @{version}{said}: p50 {fleet_p50[-1] * 1000:.0f} ms, "
                        f"p99 {fleet_p99[-1] * 1000:.0f} ms"
                    )
                else:
                    solo.append(times[0])
        p99 = statistics.median(fleet_p99)
        print(f"one node alone:  {statistics.median(solo) * 1000:7.0f} ms")
        print(
            f"{args.nodes} nodes:      p50 {statistics.median(fleet_p50) * 1000:7.0f} ms   p99 {p99 * 1000:7.0f} ms "
            f"(rounds {min(fleet_p99) * 1000:.0f}-{max(fleet_p99) * 1000:.0f} ms)   "
            f"p99 / one node x{p99 / statistics.median(solo):.1f}"
        )
        fetched = fleet.fetched_bytes()
        print(
            f"bytes fetched by the {args.nodes} nodes: {fetched / 2**20:,.0f} MiB = {fetched / size / args.nodes:.2f} "
            f"x artifact size x nodes x {args.rounds + 1} versions (each node fetches each version once)"
        )
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--artifact-mib", type=int, default=4)
    ap.add_argument("--no-staging", action="store_true", help="nodes fetch a version only when it is promoted")
    asyncio.run(main(ap.parse_args()))
