"""The served evals of gated canaries on this node (schemas/served.py): when one of its engines has loaded and
verified a version that a gated canary of this node asks for, the canary's eval runs through that engine
(evals/served.py) in a task of its own, beside the deployment, and its outcome is reported with the node's status: still
`loaded`, now with the served score, or `failed` saying why it could not be evaluated (either way the registry
decides the canary). One eval per engine and name, for the canary that asked it: a change of the alias (the canary
ends, rolls back, or another begins) cancels it before the change is rolled out, and so does a load of that name
into that engine again (it lost it), so no late report lands over a newer one.

An agent that restarts during a canary does not evaluate again what its engine already serves: the canary's deadline
rolls that one back (saying the node has no served score yet)."""

from __future__ import annotations

import asyncio
import logging

from schemas.parity import ParityFigures
from schemas.registry import AdapterVersion, Alias, Smoke
from schemas.served import describe
from services.agent.engines import Engine
from services.agent.evals.served import EvalFailed, evaluate
from services.aio import cancel_and_wait

log = logging.getLogger(__name__)


def asked(alias: Alias, node: str, version: int) -> tuple[float, str] | None:
    """The gated canary that asks this node to evaluate `version` (its start and run), or None."""
    c = alias.canary
    if c is None or c.eval is None or node not in c.nodes or c.version != version:
        return None
    return c.started, c.eval.run


class CanaryEvals:
    """The evals under way, by (engine label, adapter name), each with the version and canary it is for."""

    def __init__(self, deployment) -> None:
        self.deployment = deployment  # its node, js, http, graders context and report()
        self.tasks: dict[tuple[str, str], tuple[int, tuple[float, str], asyncio.Task]] = {}

    def start(
        self,
        engine: Engine,
        alias: Alias,
        version: AdapterVersion,
        said: str,
        checked: Smoke | None,
        parity: ParityFigures | None,
    ) -> None:
        """After a verified load: evaluate it through `engine` if a gated canary of this node asks for it."""
        canary = asked(alias, self.deployment.node, version.version)
        if canary is None:
            return
        key = (engine.label, alias.name)
        if (old := self.tasks.get(key)) is not None:
            old[2].cancel()
        task = asyncio.create_task(self._run(engine, alias, version, said, checked, parity))
        self.tasks[key] = (version.version, canary, task)
        task.add_done_callback(lambda t: self._forget(key, t))

    def _forget(self, key: tuple[str, str], task: asyncio.Task) -> None:
        if (held := self.tasks.get(key)) is not None and held[2] is task:
            del self.tasks[key]

    async def settle(self, alias: Alias) -> None:
        """Cancel, and wait for, the evals of this alias that its new state no longer asks for."""
        node = self.deployment.node
        await cancel_and_wait(
            [
                task
                for (_, name), (version, canary, task) in list(self.tasks.items())
                if name == alias.name and asked(alias, node, version) != canary
            ]
        )

    async def drop(self, engine: Engine, name: str) -> None:
        """End the eval of `name` through `engine`, which is loaded again: its verdict would be of the load before."""
        if (held := self.tasks.get((engine.label, name))) is not None:
            await cancel_and_wait([held[2]])

    async def close(self) -> None:
        await cancel_and_wait([task for *_, task in self.tasks.values()])

    async def _run(
        self,
        engine: Engine,
        alias: Alias,
        version: AdapterVersion,
        said: str,
        checked: Smoke | None,
        parity: ParityFigures | None,
    ) -> None:
        e = alias.canary.eval if alias.canary else None
        assert e is not None
        r = self.deployment
        log.info("canary of %s@%d: running eval %s through %s", version.name, version.version, e.eval, engine.label)
        try:
            served = await evaluate(r.js, engine, version.name, e, r.graders, r.http)
        except EvalFailed as err:
            why = f"{said}; its served eval {e.eval} could not be run: {err}"
            await r.report(engine, version.name, version.version, "failed", why, checked, parity)
            return
        except Exception as err:  # anything else the eval met: reported, so the canary does not wait for nothing
            why = f"{said}; its served eval {e.eval} failed: {type(err).__name__}: {err}"
            log.exception("canary of %s@%d: the served eval failed", version.name, version.version)
            await r.report(engine, version.name, version.version, "failed", why, checked, parity)
            return
        message = f"{said}; {describe(e, served)}"
        await r.report(engine, version.name, version.version, "loaded", message, checked, parity, served)
