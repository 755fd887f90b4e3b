"""Real processes for a fault test or a chaos bench: nats-server (one, or a 3-server cluster) and jetlora services,
each service behind its own NatsProxy so that it alone can be stalled, partitioned, cut off or killed.

    async with Stack(tmp_path) as stack:
        stack.start_scheduler("sched")
        stack.start_artifacts("arts")
        stack.start_agent("n1", hold_s=2.0)
        nc = await nats.connect(stack.client_url)
        ...
        stack.blackhole("n1", 2.0)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import nats

from services import bus
from services.embedded import EmbeddedNats, free_port
from tests.harness.proxy import JETSTREAM_PREFIXES, NatsProxy
from tests.harness.service import ROOT, Service, Stall, process_state

HOLD_TRAINER = f"{sys.executable} {ROOT / 'tests' / 'programs' / 'hold_trainer.py'}"
HOLD_GROUP = f"{sys.executable} {ROOT / 'tests' / 'programs' / 'hold_group.py'}"  # its co-training groups' stand-in


def cluster_servers(tmp: Path, size: int = 3) -> list[EmbeddedNats]:
    """`size` JetStream servers routed into one cluster (as tests/test_cluster.py), not started yet."""
    routes = [free_port() for _ in range(size)]
    servers = []
    for i in range(size):
        others = ", ".join(f'"nats-route://127.0.0.1:{p}"' for j, p in enumerate(routes) if j != i)
        conf = f"server_name: s{i}\ncluster {{ name: jl, host: 127.0.0.1, port: {routes[i]}, routes: [{others}] }}\n"
        servers.append(EmbeddedNats(store_dir=tmp / f"s{i}", websocket=False, extra_config=conf))
    return servers


class Stack:
    """Owns a nats-server (or a cluster) with jetlora's resources, and named service processes behind proxies."""

    def __init__(self, tmp: str | Path, cluster: bool = False, heartbeat_interval: float = 0.25):
        self.tmp = Path(tmp)
        self.cluster = cluster
        self.heartbeat_interval = heartbeat_interval
        self.servers: list[EmbeddedNats] = []
        self.services: dict[str, Service] = {}
        self._stalls: list[Stall] = []

    @property
    def client_url(self) -> str:
        """The servers themselves, comma-separated: for the test's own connection, never through a proxy."""
        return ",".join(s.url for s in self.servers)

    @property
    def replicas(self) -> int:
        return 3 if self.cluster else 1

    # --- lifecycle -------------------------------------------------------------------------------------------
    async def start(self, timeout: float = 30.0) -> "Stack":
        """Start the server(s) and create jetlora's streams and buckets (a cluster elects its meta leader first:
        tried again until `timeout`)."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        (self.tmp / "logs").mkdir(exist_ok=True)
        self.servers = cluster_servers(self.tmp) if self.cluster else [EmbeddedNats(store_dir=self.tmp / "nats")]
        try:
            for server in self.servers:
                server.start()
            await self._ensure_resources(timeout)
        except BaseException:
            self.close()
            raise
        return self

    async def _ensure_resources(self, timeout: float) -> None:
        nc = await nats.connect(servers=self.client_url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    await bus.ensure_resources(nc, replicas=self.replicas)
                    return
                except nats.errors.Error:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()

    async def __aenter__(self) -> "Stack":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process left (and agents' trainers), close the proxies, stop the servers."""
        for stall in self._stalls:
            stall.resume()
        for svc in self.services.values():
            svc.kill()
            svc.proxy.close()
        for server in self.servers:
            server.stop()

    # --- services --------------------------------------------------------------------------------------------
    def start_scheduler(self, name: str = "scheduler", *flags: str) -> subprocess.Popen:
        """`jetlora scheduler` (with the adapter registry), heartbeats every `heartbeat_interval`; no co-training
        (the stand-in trainer trains alone)."""
        base = ["--heartbeat-interval", str(self.heartbeat_interval), "--co-train", "off"]
        return self._start(name, "scheduler", base, flags)

    def start_artifacts(self, name: str = "artifacts", *flags: str) -> subprocess.Popen:
        """`jetlora artifacts`, the artifact service."""
        return self._start(name, "artifacts", [], flags)

    def start_agent(
        self,
        name: str,
        *flags: str,
        gpus: str | None = "24576",
        hold_s: float = 0.5,
        trainer: str | None = HOLD_TRAINER,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """`jetlora agent` for node `name`, as tests/conftest.py's Agents.start: simulated GPUs, the hold trainer
        (HOLD_S=`hold_s`), its work dir under the stack's tmp dir."""
        work = self.tmp / "agents" / name
        first = ["--node", name, "--work-dir", str(work), "--heartbeat-interval", str(self.heartbeat_interval)]
        if gpus:
            first += ["--simulate-gpus", gpus]
        if trainer:
            first += ["--trainer-command", trainer]
        if trainer == HOLD_TRAINER:  # its co-training groups' stand-in beside it
            first += ["--group-command", HOLD_GROUP]
        return self._start(name, "agent", first, flags, {"HOLD_S": str(hold_s), **(env or {})}, work)

    def _start(
        self,
        name: str,
        kind: str,
        first: list[str],
        flags: tuple[str, ...],
        env: dict[str, str] | None = None,
        work_dir: Path | None = None,
    ) -> subprocess.Popen:
        if name in self.services:
            raise ValueError(f"{name!r} was started already: restart() starts it again")
        # each process its own proxy; in a cluster the servers are shared out, the others tried when one is down
        urls = [s.url for s in self.servers]
        first_server = len(self.services) % len(urls)
        proxy = NatsProxy(urls[first_server:] + urls[:first_server]).start()
        replicas = ["--replicas", str(self.replicas)] if self.cluster else []
        command = [sys.executable, "-m", "services.cli", kind, "--nats", proxy.url, *replicas, *first, *flags]
        svc = Service(
            name=name,
            kind=kind,
            command=command,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            log_path=self.tmp / "logs" / f"{name}.log",
            proxy=proxy,
            work_dir=work_dir,
        )
        self.services[name] = svc
        return svc.spawn()

    def service(self, name: str) -> Service:
        try:
            return self.services[name]
        except KeyError:
            raise KeyError(f"no process named {name!r}; started: {sorted(self.services)}") from None

    def proxy(self, name: str) -> NatsProxy:
        return self.service(name).proxy

    def pid(self, name: str) -> int:
        return self.service(name).pid

    def state(self, name: str) -> str | None:
        """The process's state letter in /proc (T while stalled); None when it is gone."""
        svc = self.service(name)
        return process_state(svc.pid) if svc.alive else None

    def log(self, name: str) -> str:
        """Everything the process (all its lives) wrote to stdout and stderr."""
        return self.service(name).log()

    # --- faults ----------------------------------------------------------------------------------------------
    def stall(self, name: str, seconds: float) -> Stall:
        """SIGSTOP the process now and SIGCONT it after `seconds` (from a timer thread); returns at once."""
        svc = self.service(name)
        if not svc.alive:
            raise RuntimeError(f"{name} is not running")
        stall = Stall(svc.pid, seconds)
        self._stalls.append(stall)
        return stall

    async def stall_for(self, name: str, seconds: float) -> None:
        """stall(), and return once the process runs again (continued at once if this is cancelled)."""
        stall = self.stall(name, seconds)
        try:
            await stall.wait_async()
        finally:
            stall.resume()

    def blackhole(self, name: str, seconds: float | None = None) -> None:
        """Partition the process from NATS (TCP stays up, nothing flows) for `seconds`, or until heal(name)."""
        self.proxy(name).blackhole(seconds)

    def heal(self, name: str) -> None:
        self.proxy(name).heal()

    def hold_writes(
        self,
        name: str,
        prefixes: tuple[str, ...] = JETSTREAM_PREFIXES,
        mode: Literal["drop", "delay"] = "drop",
        seconds: float | None = None,
        delay_s: float = 0.0,
    ) -> None:
        """The process's publishes to `prefixes` dropped or delayed (see NatsProxy.hold_writes)."""
        self.proxy(name).hold_writes(prefixes, mode, seconds, delay_s)

    def release_writes(self, name: str) -> None:
        self.proxy(name).release_writes()

    def cut(self, name: str) -> int:
        """Reset the process's NATS connections; it reconnects through its proxy. Returns how many were cut."""
        return self.proxy(name).cut()

    def kill(self, name: str) -> None:
        """SIGKILL the process (and an agent's trainers that outlive it)."""
        self.service(name).kill()

    def terminate(self, name: str, timeout: float = 15.0) -> int:
        """SIGTERM, as an orderly shutdown; returns the exit code."""
        return self.service(name).terminate(timeout)

    def restart(self, name: str) -> subprocess.Popen:
        """Start the process again with the same command line and proxy (killed first if it still runs)."""
        svc = self.service(name)
        if svc.alive:
            svc.kill()
        return svc.spawn()
