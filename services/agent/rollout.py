"""Keeping a node's serving engines on what the registry's aliases point at: watch the aliases, fetch each
adapter once per sha256, check it, load it, report how that went; unload what is retired.

What was loaded is remembered on disk, so an agent that restarts converges without loading anything twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client

from schemas import names
from schemas.registry import Alias, AdapterVersion, NodeAdapterStatus, NodeState, StoredFile
from services.agent.engines import Engine, answering, load, restart, smoke, unload
from services.artifacts.download import fetch_object, safe_extract
from services.aio import sleep_unless_stopped
from services.registry.store import AdapterRegistry

log = logging.getLogger(__name__)
_alias = msgspec.json.Decoder(Alias)
_enc = msgspec.json.Encoder()


class Rollout:
    def __init__(self, nc: Client, node: str, engines: list[Engine], work_dir: Path) -> None:
        self.nc, self.js, self.node, self.engines = nc, nc.jetstream(), node, engines
        self.root = work_dir / "adapters"
        self.state_file = self.root / "loaded.json"
        # engine label -> adapter name -> [version, sha256] of what that engine serves under the name
        self.loaded: dict[str, dict[str, list]] = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.ready = asyncio.Event()  # the aliases there were at start are converged to
        self.versions: dict[tuple[str, int], AdapterVersion] = {}  # versions never change: read each once

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the aliases until `stop`; a watch the server breaks (a restart, a limit) is opened again."""
        if not self.engines:
            return
        await self._start_engines()
        log.info("rollout: %s follow the adapter registry", ", ".join(e.label for e in self.engines))
        pause = 0.5
        while not stop.is_set():
            began = time.monotonic()
            try:
                await self._follow(stop)
            except Exception as e:
                if time.monotonic() - began > 60:  # it had worked for a while: a fresh failure
                    pause = 0.5
                log.warning("rollout: following the adapter registry failed (%s: %s); trying again in %.1fs",
                            type(e).__name__, e, pause)
                await sleep_unless_stopped(stop, pause)
                pause = min(pause * 2, 30.0)

    async def _follow(self, stop: asyncio.Event) -> None:
        kv = await self.js.key_value(names.ADAPTERS_KV)
        self.registry = AdapterRegistry(kv)
        watcher = await kv.watch(names.adapter_alias_key(), ignore_deletes=True)
        try:
            while not stop.is_set():
                try:
                    entry = await watcher.updates(timeout=1.0)
                except (asyncio.TimeoutError, TimeoutError):
                    continue
                if entry is None:  # the end of the initial values
                    self.ready.set()
                    continue
                if not entry.value:
                    continue  # a deleted key
                await self.converge(_alias.decode(entry.value))
        finally:
            await watcher.stop()

    async def _start_engines(self) -> None:
        """An engine with a restart command that does not answer yet is started with it (llama-server, with the
        adapters placed for it before)."""
        for engine in self.engines:
            if engine.restart and engine.url and not await answering(engine):
                log.info("engine %s does not answer: starting it with %r", engine.label, engine.restart)
                try:
                    await restart(engine)
                except Exception as e:
                    log.warning("engine %s could not be started: %s", engine.label, e)

    async def converge(self, alias: Alias) -> None:
        """Each engine of this node serves alias.current under alias.name (or nothing, once retired)."""
        version = None
        if alias.current is not None and not alias.retired:
            key = (alias.name, alias.current)
            version = self.versions.get(key) or await self.registry.version(*key)
            if version is not None:
                self.versions[key] = version
        async with self.locks.setdefault(alias.name, asyncio.Lock()):
            for engine in self.engines:
                try:
                    await self._converge_engine(engine, alias, version)
                except Exception as e:
                    log.warning("rollout of %s on %s failed: %s", alias.name, engine.label, e)
                    if version is not None:
                        await self._report(engine, version.name, version.version, "failed", str(e))

    async def _converge_engine(self, engine: Engine, alias: Alias, version: AdapterVersion | None) -> None:
        have = self.loaded.get(engine.label, {}).get(alias.name)
        if version is None:
            if have:
                message = await unload(engine, alias.name)
                self._remember(engine, alias.name, None)
                await self._report(engine, alias.name, have[0], "unloaded", message)
            return
        if version.base_model != engine.model:
            return  # another base model's adapter: for other engines
        if refusal := engine.refusal(version):
            await self._report(engine, version.name, version.version, "failed", f"refused: {refusal}")
            return
        file = engine.needs(version)
        if have == [version.version, file.sha256]:  # loaded before (this run or an earlier one): nothing twice
            log.info("adapter %s@%d is served by %s already", version.name, version.version, engine.label)
            return
        await self._report(engine, version.name, version.version, "loading", f"fetching {file.name}")
        local = await self._fetch(file, gguf=engine.kind == "llamacpp")
        state, message = await load(engine, version.name, local)
        self._remember(engine, version.name, [version.version, file.sha256])
        checked = await smoke(engine, version.name) if state == "loaded" and engine.url else None
        await self._report(engine, version.name, version.version, state, message, checked)

    async def _fetch(self, file: StoredFile, gguf: bool) -> Path:
        """The artifact on local disk, fetched once per sha256 and checked against the registry's sha256. It is
        fetched (and extracted) beside its place and renamed into it whole, so a crash or a full disk half way
        leaves nothing that looks fetched."""
        target = self.root / file.sha256 / ("adapter.gguf" if gguf else "peft")
        if target.exists():
            return target
        download = target.parent / ("adapter.gguf.part" if gguf else "peft.tar.gz")
        try:
            await fetch_object(self.js, names.ARTIFACTS_BUCKET, file.name, download, file.sha256)  # corrupted: refused
        except Exception as e:
            raise RuntimeError(f"refused {file.name}: {e}") from None
        if gguf:
            download.replace(target)
            return target
        partial = target.with_name("peft.partial")
        await asyncio.to_thread(shutil.rmtree, partial, True)  # what an earlier crash left
        await asyncio.to_thread(safe_extract, download, partial)
        partial.replace(target)
        download.unlink()
        return target

    def _remember(self, engine: Engine, name: str, what: list | None) -> None:
        served = self.loaded.setdefault(engine.label, {})
        if what is None:
            served.pop(name, None)
        else:
            served[name] = what
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.loaded))
        tmp.replace(self.state_file)

    async def _report(self, engine: Engine, name: str, version: int, state: NodeState, message: str,
                      checked=None) -> None:
        status = NodeAdapterStatus(name=name, version=version, node=self.node, engine=engine.label, state=state,
                                   message=message, smoke=checked, updated=time.time())
        log.info("adapter %s@%d on %s: %s %s", name, version, engine.label, state, message)
        try:
            await self.registry.put_node_status(status)
            await self.nc.publish(names.adapter_status(self.node), _enc.encode(status))
        except Exception as e:  # NATS away: the next change reports again
            log.warning("adapter status not sent: %s", e)
