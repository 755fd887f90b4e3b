"""Keeping a node's serving engines on what the registry's aliases point at: watch the aliases, fetch each
adapter once per sha256, check it, load it, verify the engine answers as the adapter's trainer did, report how
that went; unload what is retired. And keep checking: an engine that restarted, or lost an adapter, gets it back.

A version registered for a name the node serves is fetched ahead of its promotion (staging.py); an engine with a
cap on the names it keeps loaded unloads the least recently used past it (engine_cap.py); a gated canary's version,
once loaded and verified, is evaluated through the engine (evals/canary.py), and so is an eval run of a name it
serves that the evals service sends this node (evals/runs.py).
What was loaded is remembered on disk (served_state.py), so an agent that restarts converges without loading
anything twice (and the checks find what an engine lost meanwhile). Nothing here waits on an engine or the disk on
the event loop (it also sends the node's heartbeats): engines are asked through aiohttp (engine_http.py), files are
read, written and removed in threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.micro.service import Group

from schemas import names
from schemas.registry import Alias, AdapterVersion, NodeAdapterStatus, NodeState, Smoke, StoredFile
from services.agent import llamacpp, vllm
from services.agent.adapter_cache import AdapterCache
from services.agent.adapter_files import download
from services.agent.evals.canary import CanaryEvals
from services.agent.engine_cap import EngineCap
from services.agent.engine_http import EngineHttp
from services.agent.engines import Engine, answering, verify
from services.agent.evals.runs import EvalRuns
from services.agent.parity import ParityCheck
from services.agent.registry_bucket import RegistryBucket
from services.agent.evals.served import grader_context
from services.agent.served_state import ServedState
from services.agent.staging import Stager
from services.aio import cancel_and_wait, sleep_unless_stopped
from services.controller import keep, watch_kv

log = logging.getLogger(__name__)
_alias = msgspec.json.Decoder(Alias)
_enc = msgspec.json.Encoder()
CHECK_INTERVAL_S = 10.0  # how often the agent compares what each engine serves with what it should


def driver(engine: Engine):
    """The module that loads adapters into this kind of engine (load, unload, served)."""
    return llamacpp if engine.kind == "llamacpp" else vllm


class Deployment:
    """The node's side of deploying adapters: its engines kept on what the registry's names point at."""

    def __init__(
        self,
        nc: Client,
        node: str,
        engines: list[Engine],
        work_dir: Path,
        check_interval: float = CHECK_INTERVAL_S,
        stage: bool = True,
        cache_bytes: int = 10 * 2**30,
        grader_env: dict[str, str] | None = None,
    ) -> None:
        self.nc, self.js, self.node, self.engines = nc, nc.jetstream(), node, engines
        self.root = work_dir / "adapters"
        self.served = ServedState(self.root / "loaded.json")  # what each engine serves (read when run() starts)
        self.locks: dict[str, asyncio.Lock] = {}
        self.ready = asyncio.Event()  # the aliases there were at start are converged to
        self.versions: dict[tuple[str, int], AdapterVersion] = {}  # versions never change: read each once
        self.aliases: dict[str, Alias] = {}  # the newest of each alias seen
        self.check_interval = check_interval
        self.up: dict[str, bool] = {}  # engine label -> whether it answered at the last check
        self.fetching: dict[tuple[str, bool], asyncio.Task] = {}  # (sha256, gguf) -> its fetch under way
        self.stager = Stager(self) if stage else None
        self.cache = AdapterCache(self.root, cache_bytes)
        self.http = EngineHttp()  # every engine call of the deployment; closed when run() ends
        self.cap = EngineCap(self)  # --engine-max-adapters: the least recently used names unloaded past it
        self.parity = ParityCheck(self.http)  # the engines' log-probabilities against the trainers' (parity.py)
        self.graders = grader_context(grader_env or {}, work_dir)  # where gated canaries' evals are graded
        self.evals = CanaryEvals(self)  # gated canaries' evals through the engines (evals/canary.py)
        self.runs = EvalRuns(self)  # eval runs through the engines, asked by the evals service (evals/runs.py)

    async def run(self, stop: asyncio.Event, serving: Group | None = None) -> None:
        """Follow the aliases until `stop`, and check what each engine really serves; a watch the server breaks (a
        restart, a limit) is opened again. serving: the agent's nats.micro group, where this node's eval runs are
        asked (evals/runs.py; without it, none are answered)."""
        if not self.engines:
            return
        try:
            await self.served.read()
            await self._start_engines()
            await self._run(stop, serving)
        finally:
            await self.http.close()

    async def _run(self, stop: asyncio.Event, serving: Group | None) -> None:
        log.info("deploy: %s follow the adapter registry", ", ".join(e.label for e in self.engines))
        if serving is not None:
            await self.runs.serve(serving)
        checking = asyncio.create_task(self._check_engines(stop))
        staging = (
            asyncio.create_task(keep(stop, "deploy: staging new versions", self.stager.follow)) if self.stager else None
        )
        try:
            await keep(stop, "deploy: following the adapter registry", self._follow)
        finally:
            await cancel_and_wait([checking, staging, *self.fetching.values()])
            await self.evals.close()
            await self.runs.close()

    async def _follow(self, stop: asyncio.Event) -> None:
        """Converge to each alias as it changes (those there are first: then `ready`)."""
        kv = await self.js.key_value(names.ADAPTERS_KV)
        self.registry = RegistryBucket(kv)

        async def changed(entry) -> None:
            if entry.value:  # (not a deleted key)
                await self.converge(_alias.decode(entry.value))

        async def current() -> None:
            self.ready.set()

        await watch_kv(kv, names.adapter_alias_key(), stop, changed, current)

    async def _start_engines(self) -> None:
        """An engine with a restart command that does not answer yet is started with it (llama-server, with the
        adapter placed for it before)."""
        for engine in self.engines:
            if engine.restart and engine.url and not await answering(engine, http=self.http):
                log.info("engine %s does not answer: starting it with %r", engine.label, engine.restart)
                try:
                    await llamacpp.restart(engine)
                except Exception as e:
                    log.warning("engine %s could not be started: %s", engine.label, e)

    async def converge(self, alias: Alias, again: bool = False, engine: Engine | None = None) -> None:
        """Each engine of this node (or just `engine`) serves the alias's version for this node (the canary's on a
        canary node, else the current one) under alias.name, or nothing once retired; then the engines are kept
        within their caps (engine_cap.py). again: load it even where it was loaded (or parked) before (the engine
        lost it; its cap has room again)."""
        self.aliases[alias.name] = alias
        await self.evals.settle(alias)  # an eval the alias no longer asks for ends before anything changes
        version = None
        if (target := alias.serving(self.node)) is not None:
            key = (alias.name, target)
            version = self.versions.get(key) or await self.registry.version(*key)
            if version is not None:
                self.versions[key] = version
        async with self.locks.setdefault(alias.name, asyncio.Lock()):
            for each in [engine] if engine else self.engines:
                try:
                    await self._converge_engine(each, alias, version, again)
                except Exception as e:
                    log.warning("deploying %s on %s failed: %s", alias.name, each.label, e)
                    if version is not None:
                        await self.report(each, version.name, version.version, "failed", str(e))
        if engine is None:  # (a reload into a cap's room is the cap's own)
            await self.cap.enforce()
        await self._trim()  # what the engines served before may be unused now

    async def _converge_engine(
        self, engine: Engine, alias: Alias, version: AdapterVersion | None, again: bool = False
    ) -> None:
        have = self.served.of(engine.label).get(alias.name)
        parked = self.served.parked(engine.label).get(alias.name)
        if version is None:
            if had := have or parked:
                state, message = await driver(engine).unload(engine, alias.name, http=self.http)
                await self.served.remember(engine.label, alias.name, None)
                await self.report(engine, alias.name, had[0], state, message)
            return
        if version.base_model != engine.model:
            return  # another base model's adapter: for other engines
        if refusal := engine.refusal(version):
            await self.report(engine, version.name, version.version, "failed", f"refused: {refusal}")
            return
        file = engine.needs(version)
        if have == [version.version, file.sha256] and not again:  # loaded before (this run or an earlier one)
            log.info("adapter %s@%d is served by %s already", version.name, version.version, engine.label)
            return
        if parked == [version.version, file.sha256] and not again:
            return  # unloaded to keep the engine within its cap: back when promoted anew, or there is room
        await self.evals.drop(engine, alias.name)  # an eval of what it loaded before would report it stale
        gguf = engine.kind == "llamacpp"
        staged = await asyncio.to_thread(self._local(file, gguf).exists)
        await self.report(
            engine, version.name, version.version, "loading", f"{'staged' if staged else 'fetching'} {file.name}"
        )
        with self.cache.holding(file.sha256):  # not evicted between its fetch and the engine's load
            local = await self.fetch(file, gguf)
            if gguf and not await asyncio.to_thread(llamacpp.placed_names, engine):  # it serves its base alone
                await self.parity.note_base(engine, version)
            state, message = await driver(engine).load(engine, version.name, local, http=self.http)
            await self.served.remember(engine.label, version.name, [version.version, file.sha256])
            self.cap.used(engine, version.name)
        checked = parity = None
        if state == "loaded" and engine.url:
            state, said, checked = await self._verify(engine, version, file.sha256)
            state, said, parity = await self.parity.judged(engine, version, state, said)
            message = f"{message}; {said}"
        await self.report(engine, version.name, version.version, state, message, checked, parity)
        if state == "loaded" and engine.url:
            self.evals.start(engine, alias, version, message, checked, parity)

    async def _verify(self, engine: Engine, version: AdapterVersion, sha256: str) -> tuple[NodeState, str, Smoke]:
        """`loaded` only if the engine answers the version's probe as its trainer did (and vLLM's runtime API says
        it serves the name from this version's files); parity is judged after (parity.py)."""
        state, said, answer = await verify(engine, version, http=self.http)
        if engine.kind == "vllm" and state == "loaded":
            root = ((await vllm.served(engine, http=self.http)) or {}).get(version.name, "")
            if sha256 not in root:
                return (
                    "mismatch",
                    f"vLLM serves {version.name} from {root or 'nowhere'}, not this version's files",
                    answer,
                )
        return state, said, answer

    # --- what the engines really serve ------------------------------------------------------------
    async def _check_engines(self, stop: asyncio.Event) -> None:
        """Every check_interval: an engine that lost an adapter it should serve (it restarted; someone unloaded it)
        gets it back, and one that comes back after not answering is checked against each adapter's probe; then
        each engine's requests say which adapters were used, and a capped one is kept within its cap."""
        while not await sleep_unless_stopped(stop, self.check_interval):
            for engine in self.engines:
                if engine.url:
                    try:
                        await self.check_engine(engine)
                    except Exception as e:
                        log.warning(
                            "deploy: checking %s failed (%s: %s); the next check goes on",
                            engine.label,
                            type(e).__name__,
                            e,
                        )
            await self.cap.enforce()

    async def check_engine(self, engine: Engine) -> None:
        serves = await driver(engine).served(engine, http=self.http)  # None: no answer, or it cannot say
        up = serves is not None or await answering(engine, http=self.http)
        came_back, self.up[engine.label] = up and not self.up.get(engine.label, True), up
        if not up:
            return
        for name, (version, sha256) in list(self.served.of(engine.label).items()):
            alias = self.aliases.get(name)
            if alias is None or alias.serving(self.node) != version:
                continue  # a change is on its way through converge
            if engine.kind == "llamacpp" and not engine.restart:
                continue  # it said needs-restart, and that stands until its operator restarts it
            if serves is not None and engine.kind != "vllm-dir":  # the resolver loads it again on its next request
                lost = name not in serves or (engine.kind == "vllm" and sha256 not in serves[name])
            elif came_back:
                lost = (await verify(engine, await self._version(name, version), http=self.http))[0] != "loaded"
            else:
                lost = False
            if lost:
                log.warning(
                    "engine %s no longer serves %s@%d (%s); loading it again",
                    engine.label,
                    name,
                    version,
                    "it came back" if came_back else "not in what it lists",
                )
                await self.converge(alias, again=True)

    async def _version(self, name: str, version: int) -> AdapterVersion:
        found = self.versions.get((name, version)) or await self.registry.version(name, version)
        if found is None:
            raise RuntimeError(f"{name}@{version} is not in the registry")
        self.versions[(name, version)] = found
        return found

    async def fetch(self, file: StoredFile, gguf: bool) -> Path:
        """The artifact on local disk, fetched once per sha256 (a promotion and its staging share one fetch)."""
        key = (file.sha256, gguf)
        if key not in self.fetching:
            self.fetching[key] = asyncio.create_task(self._fetch(file, gguf))
            self.fetching[key].add_done_callback(lambda _: self.fetching.pop(key, None))
        return await asyncio.shield(self.fetching[key])

    async def _fetch(self, file: StoredFile, gguf: bool) -> Path:
        """On disk, then the cache back under its budget (never removing what engines serve or are loading). Held
        in the cache while it is fetched, so an eviction under way in a thread leaves it be (or ends first)."""
        target = self._local(file, gguf)
        with self.cache.holding(file.sha256):
            await self.cache.settled(file.sha256)
            if await asyncio.to_thread(self.cache.present, file.sha256, target):
                return target
            await download(self.js, file, gguf, target)
            await self._trim(fetched=file.sha256)
        return target

    async def _trim(self, fetched: str = "") -> None:
        """The adapter cache back under its budget, walked and removed in a thread; what engines serve, loads hold
        and fetches write stay (a load or fetch that starts meanwhile holds its adapter: AdapterCache)."""
        try:
            await self.cache.evict_async(self.served.shas() | {sha for sha, _ in self.fetching}, fetched)
        except OSError as e:  # the deployment goes on; the next fetch or deploy trims again
            log.warning("adapter cache: could not trim %s to its budget: %s", self.root, e)

    def _local(self, file: StoredFile, gguf: bool) -> Path:
        return self.root / file.sha256 / ("adapter.gguf" if gguf else "peft")

    async def report(
        self,
        engine: Engine,
        name: str,
        version: int,
        state: NodeState,
        message: str,
        checked=None,
        parity=None,
        served=None,
    ) -> None:
        status = NodeAdapterStatus(
            name=name,
            version=version,
            node=self.node,
            engine=engine.label,
            state=state,
            message=message,
            smoke=checked,
            parity=parity,
            served=served,
            updated=time.time(),
        )
        log.info("adapter %s@%d on %s: %s %s", name, version, engine.label, state, message)
        try:
            await self.registry.put_node_status(status)
            await self.nc.publish(names.adapter_status(self.node), _enc.encode(status))
        except Exception as e:  # NATS away: the next change reports again
            log.warning("adapter status not sent: %s", e)
