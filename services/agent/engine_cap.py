"""An operator's cap on the adapter names one vLLM engine keeps loaded (--engine-max-adapters). Every promotion adds
a name to every engine of its base model and nothing else takes one away, so without a cap an engine collects
names until vLLM's LoRA slots (--max-cpu-loras) run out. It applies to vLLM engines with an address (vllm=URL,
vllm-dir=DIR,URL): the agent unloads through vLLM's runtime API.

Past the cap, the least recently used names go. "Used" is the later of the agent loading the name into the engine
(a promotion, a rollback, a reload) and vLLM's own metrics showing it in a running or waiting request (the newest
`vllm:lora_requests_info` series, read at each engine check and before each unload); a name in a request then, or
being loaded, is never unloaded. These times are the agent's memory: one that restarts counts every name as used at its start (the
first by name go first), until requests or promotions say otherwise.

A name that goes stays promoted and is remembered as parked (served_state.py), and its node reports it honestly:
the runtime API's is unloaded (`unloaded`, saying it is over the cap) and loaded again when a name above it goes (a
retire); the filesystem resolver's stays placed (`on-demand`): vLLM loads it again at its next request, which makes
it recently used, and the least recently used of the names vLLM then holds goes instead. A parked name's files are
no longer held in the node's adapter cache (the placed copy of vllm-dir is its own), so the cache may remove them."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from schemas.registry import Alias, NodeState
from services.agent import vllm
from services.agent.engine_http import EngineHttp
from services.agent.engines import Engine
from services.agent.served_state import ServedState

log = logging.getLogger(__name__)


class Deployment(Protocol):
    """What the cap needs of the deployment that holds it (services/agent/deployment.py)."""

    engines: list[Engine]
    http: EngineHttp
    served: ServedState
    locks: dict[str, asyncio.Lock]
    aliases: dict[str, Alias]

    async def report(
        self, engine: Engine, name: str, version: int, state: NodeState, message: str, checked=None
    ) -> None: ...

    async def converge(self, alias: Alias, again: bool = False, engine: Engine | None = None) -> None: ...


class EngineCap:
    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.used_at: dict[tuple[str, str], float] = {}  # (engine label, name) -> monotonic time last used
        self.started = time.monotonic()
        self._one = asyncio.Lock()  # one enforcement at a time: two would unload or reload the same name twice

    def capped(self) -> list[Engine]:
        return [e for e in self.deployment.engines if e.max_adapters > 0 and e.url and e.kind in ("vllm", "vllm-dir")]

    def used(self, engine: Engine, name: str) -> None:
        self.used_at[(engine.label, name)] = time.monotonic()

    def _recency(self, engine: Engine):
        return lambda name: (self.used_at.get((engine.label, name), self.started), name)

    async def enforce(self) -> None:
        """Every capped engine back within its cap (and, for the runtime API, parked names back into free room)."""
        async with self._one:
            for engine in self.capped():
                try:
                    await self._enforce(engine)
                except Exception as e:  # the engine away: the next check or deploy tries again
                    log.warning(
                        "deploy: keeping %s within %d adapters failed (%s: %s); the next check tries again",
                        engine.label,
                        engine.max_adapters,
                        type(e).__name__,
                        e,
                    )

    async def _enforce(self, engine: Engine) -> None:
        r = self.deployment
        listed = await vllm.served(engine, http=r.http)
        if listed is None:
            return  # it does not answer: the next check
        busy = await vllm.in_flight(engine, http=r.http) or set()
        for name in busy:
            self.used(engine, name)
        served, parked = r.served.of(engine.label), r.served.parked(engine.label)
        held = set(served) | {name for name in parked if name in listed}  # vllm-dir: resolved again on demand
        over = len(held) - engine.max_adapters
        if over > 0:
            converging = {name for name in held if (lock := r.locks.get(name)) is not None and lock.locked()}
            idle = sorted(held - busy - converging, key=self._recency(engine))  # (one being loaded is in use)
            if len(idle) < over:
                log.warning(
                    "deploy: %s holds %d adapters, over its cap of %d, and requests (or loads) use all but %d of "
                    "them now; the others go once idle",
                    engine.label,
                    len(held),
                    engine.max_adapters,
                    len(idle),
                )
            for name in idle[:over]:
                await self._park(engine, name)
        elif over < 0 and engine.kind == "vllm":
            for name in sorted(parked, key=self._recency(engine), reverse=True)[:-over]:
                await self._reload(engine, name)

    async def _park(self, engine: Engine, name: str) -> None:
        """Unload `name` from the engine, still promoted; reported the first time it goes."""
        r = self.deployment
        async with r.locks.setdefault(name, asyncio.Lock()):
            served, parked = r.served.of(engine.label).get(name), r.served.parked(engine.label).get(name)
            if served is None and parked is None:
                return  # retired meanwhile
            state, message = await vllm.park(engine, name, http=r.http)
            if served is None:
                return  # vllm-dir: parked before, resolved again by a request since
            await r.served.remember(engine.label, name, served, parked=True)
            message = (
                f"over this engine's cap of {engine.max_adapters} adapter{'s' if engine.max_adapters > 1 else ''} "
                f"(--engine-max-adapters) and the least recently used: {message}"
            )
            await r.report(engine, name, served[0], state, message)

    async def _reload(self, engine: Engine, name: str) -> None:
        """A parked name into the room a name that went left."""
        r = self.deployment
        alias = r.aliases.get(name)
        if alias is None:
            return
        log.info("deploy: %s has room under its cap of %d again: loading %s", engine.label, engine.max_adapters, name)
        await r.converge(alias, engine=engine, again=True)
