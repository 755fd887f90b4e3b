"""Every read and write of the adapter registry's KV bucket. Versions are created, never overwritten; an alias
changes only by compare-and-set on the revision it was read at, so concurrent changes cannot interleave."""

from __future__ import annotations

import asyncio
import time

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError

from schemas import names
from schemas.registry import Alias, AdapterVersion, NodeAdapterStatus

_version = msgspec.json.Decoder(AdapterVersion)
_alias = msgspec.json.Decoder(Alias)
_status = msgspec.json.Decoder(NodeAdapterStatus)
_enc = msgspec.json.Encoder()
CAS_ATTEMPTS = 20


class RegistryError(Exception):
    """A change the registry refuses: what is wrong and what to do."""


class Moved(RegistryError):
    """The alias is not where the caller expected: another change came first."""


async def read_all(kv, pattern: str) -> dict[str, bytes]:
    """The current value of every key matching `pattern` (a snapshot, through a watcher that stops at its end)."""
    try:
        watcher = await kv.watch(pattern, ignore_deletes=True)
    except NoKeysError:
        return {}
    out = {}
    try:
        while (entry := await watcher.updates(timeout=5.0)) is not None:
            if entry.value:
                out[entry.key] = entry.value
    finally:
        await watcher.stop()
    return out


class AdapterRegistry:
    def __init__(self, kv) -> None:
        self.kv = kv

    # --- reading ---------------------------------------------------------------------------------
    async def alias(self, name: str) -> tuple[Alias | None, int]:
        try:
            entry = await self.kv.get(names.adapter_alias_key(name))
        except KeyNotFoundError:
            return None, 0
        return (_alias.decode(entry.value), entry.revision) if entry.value else (None, entry.revision)

    async def version(self, name: str, version: int) -> AdapterVersion | None:
        try:
            entry = await self.kv.get(names.adapter_version_key(name, version))
        except KeyNotFoundError:
            return None
        return _version.decode(entry.value)

    async def versions(self, name: str) -> list[AdapterVersion]:
        found = await read_all(self.kv, names.adapter_version_key(name, "*"))
        return sorted((_version.decode(v) for v in found.values()), key=lambda v: v.version)

    async def aliases(self) -> list[Alias]:
        return sorted((_alias.decode(v) for v in (await read_all(self.kv, names.adapter_alias_key())).values()),
                      key=lambda a: a.name)

    async def node_statuses(self, name: str) -> list[NodeAdapterStatus]:
        found = await read_all(self.kv, names.adapter_node_key(name, "*"))
        return sorted((_status.decode(v) for v in found.values()), key=lambda s: s.node)

    # --- writing ---------------------------------------------------------------------------------
    async def add_version(self, draft: AdapterVersion) -> AdapterVersion:
        """Store the draft as the next version of its name; the number is taken from the alias by CAS."""
        for _ in range(CAS_ATTEMPTS):
            alias, revision = await self.alias(draft.name)
            alias = alias or Alias(name=draft.name)
            number = alias.latest + 1
            if not await self._put_alias(msgspec.structs.replace(alias, latest=number, updated=time.time()), revision):
                continue
            version = msgspec.structs.replace(draft, version=number, created=time.time())
            try:
                await self.kv.create(names.adapter_version_key(draft.name, number), _enc.encode(version))
            except KeyWrongLastSequenceError:  # written before, by a registration that failed half way: next number
                continue
            return version
        raise RegistryError(f"could not register {draft.name}: its alias kept changing; try again")

    async def change_alias(self, name: str, change, expect: int | None) -> Alias:
        """Apply change(alias) -> alias by compare-and-set; `expect` (0: none) is the current version the caller
        saw, and the change is refused (Moved) if the alias moved since."""
        for _ in range(CAS_ATTEMPTS):
            alias, revision = await self.alias(name)
            if alias is None:
                raise RegistryError(f"no adapter named {name}; `jetlora adapters ls` lists them")
            if expect is not None and (alias.current or 0) != expect:
                raise Moved(f"{name} serves {_at(alias)} now, not the expected "
                            f"{'no version' if not expect else f'{name}@{expect}'}: another change came first; "
                            "look again (`jetlora adapters show`) and repeat if still wanted")
            changed = msgspec.structs.replace(change(alias), updated=time.time())
            if await self._put_alias(changed, revision):
                return changed
            if expect is not None:
                alias, _ = await self.alias(name)
                raise Moved(f"{name} changed while this change was made (it serves {_at(alias)} now); look again "
                            "and repeat if still wanted")
        raise RegistryError(f"{name} kept changing; try again")

    async def _put_alias(self, alias: Alias, revision: int) -> bool:
        key = names.adapter_alias_key(alias.name)
        try:
            if revision:
                await self.kv.update(key, _enc.encode(alias), last=revision)
            else:
                await self.kv.create(key, _enc.encode(alias))
            return True
        except KeyWrongLastSequenceError:
            await asyncio.sleep(0)
            return False

    async def put_node_status(self, status: NodeAdapterStatus) -> None:
        await self.kv.put(names.adapter_node_key(status.name, status.node), _enc.encode(status))


def _at(alias: Alias | None) -> str:
    if alias is None or alias.current is None:
        return "no version"
    return f"{alias.name}@{alias.current}"
