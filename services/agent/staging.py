"""Staging: a new version of an adapter this node serves is fetched the moment it is registered, so that promoting
it later (a canary, a rollback to it) finds it on disk and the swap is only the engine's load and its check."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.js.api import DeliverPolicy

from schemas import names, nats_subjects
from schemas.registry import AdapterVersion
from services.aio import cancel_and_wait

log = logging.getLogger(__name__)
_version = msgspec.json.Decoder(AdapterVersion)


class Stager:
    """Follows the versions registered from now on and fetches, one at a time, the newest of each adapter name that
    this node's engines serve (a name it does not serve yet is fetched when it is first promoted)."""

    def __init__(self, deployment) -> None:
        self.deployment = deployment
        self.waiting: dict[str, AdapterVersion] = {}  # name -> the newest version registered and not yet staged
        self.wake = asyncio.Event()
        self.staged = 0  # versions fetched ahead of their promotion, for the log and the tests

    async def follow(self, stop: asyncio.Event) -> None:
        """Until `stop`: take each version registered from now on (an error ends it, for the caller to retry)."""
        subject = nats_subjects.kv(names.ADAPTERS_KV).prefix + names.adapter_version_key("*", "*")
        sub = await self.deployment.js.subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
        fetching = asyncio.create_task(self._fetch_each(stop))
        try:
            while not stop.is_set() and not fetching.done():
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except (asyncio.TimeoutError, TimeoutError):
                    continue
                if msg.data:
                    self.offer(_version.decode(msg.data))
            if fetching.done():
                fetching.result()  # it failed: raised for the caller to start again
        finally:
            await sub.unsubscribe()
            await cancel_and_wait([fetching])

    def offer(self, version: AdapterVersion) -> None:
        alias = self.deployment.aliases.get(version.name)
        if alias is None or alias.serving(self.deployment.node) is None or not self._engines(version):
            return
        if version.version > getattr(self.waiting.get(version.name), "version", 0):
            self.waiting[version.name] = version  # an older one not fetched yet is passed over
            self.wake.set()

    def _engines(self, version: AdapterVersion) -> list:
        return [e for e in self.deployment.engines if e.model == version.base_model and not e.refusal(version)]

    async def _fetch_each(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.wake.wait()
            self.wake.clear()
            while self.waiting:
                name = next(iter(self.waiting))
                await self.stage(self.waiting.pop(name))

    async def stage(self, version: AdapterVersion) -> None:
        """Fetch what each engine of its base model will load; a failure is left to the promotion to meet again."""
        for engine in self._engines(version):
            file = engine.needs(version)
            try:
                await self.deployment.fetch(file, gguf=engine.kind == "llamacpp")
            except Exception as e:
                log.warning(
                    "staging %s@%d for %s failed (%s); a promotion fetches it again",
                    version.name,
                    version.version,
                    engine.label,
                    e,
                )
                continue
            self.staged += 1
            log.info(
                "staged %s@%d for %s (%s), ready for its promotion",
                version.name,
                version.version,
                engine.label,
                file.name,
            )
