"""Every read and write of the adapter registry's KV bucket. Versions are created, never overwritten; an alias
changes only by compare-and-set on the revision it was read at, so concurrent changes cannot interleave."""

from __future__ import annotations

import asyncio
import time

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from schemas import names
from schemas.registry import AdapterReply, AdapterVersion, Alias, NodeAdapterStatus
from services.streamview import LatestView, kv_view

_version = msgspec.json.Decoder(AdapterVersion)
_alias = msgspec.json.Decoder(Alias)
_status = msgspec.json.Decoder(NodeAdapterStatus)
_enc = msgspec.json.Encoder()
CAS_ATTEMPTS = 20


class RegistryError(Exception):
    """A change the registry refuses: what is wrong and what to do."""


class Moved(RegistryError):
    """The alias is not where the caller expected: another change came first."""


_decoders: dict[str, msgspec.json.Decoder] = {"alias": _alias, "version": _version, "node": _status}


def adapter_of(key: str) -> str | None:
    """The adapter name a registry key belongs to (`alias.<name>`, `version.<name>.<n>`, `node.<name>.<node>`)."""
    kind, _, rest = key.partition(".")
    if kind not in _decoders or not rest:
        return None
    return rest.partition(".")[0]


def adapter_subjects(name: str) -> list[str]:
    """The bucket's subjects that hold the keys of an adapter (`adapter_of` is `name`): alias.N, and version.N.x
    and node.N.x."""
    prefix = names.kv(names.ADAPTERS_KV).prefix
    return [f"{prefix}*.{name}", f"{prefix}*.{name}.*"]


def registry_view(js) -> LatestView:
    """Every alias, version and node status of the registry, decoded, kept current by one consumer and indexed by
    adapter name, so that one adapter is read without walking (or asking the stream about) the others."""
    return kv_view(
        js,
        names.ADAPTERS_KV,
        lambda key, data: _decoders[key.partition(".")[0]].decode(data),
        group=adapter_of,
        group_subjects=adapter_subjects,
    )


class AdapterRegistry:
    """Reads one key by a direct lookup; reads that span keys (aliases, versions, node statuses) come from `view`,
    which only a service that answers them runs (the registry service)."""

    def __init__(self, kv, view: LatestView | None = None) -> None:
        self.kv, self.view = kv, view

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

    async def adapters(self, only: str | None = None) -> dict[str, AdapterReply]:
        """Each adapter (or just `only`, from the view's index of its keys) with its versions and node statuses,
        as of this request, in one pass."""
        if self.view is None:
            raise RuntimeError("this AdapterRegistry has no view: only the registry service lists adapters")
        keys = await (self.view.snapshot() if only is None else self.view.snapshot_group(only))
        aliases: dict[str, Alias] = {}
        versions: dict[str, list[AdapterVersion]] = {}
        nodes: dict[str, list[NodeAdapterStatus]] = {}
        for key, value in keys.items():
            kind, _, rest = key.partition(".")
            name = rest.partition(".")[0]
            if kind == "alias":
                aliases[name] = value
            else:
                (versions if kind == "version" else nodes).setdefault(name, []).append(value)
        return {
            name: AdapterReply(
                alias=alias,
                versions=sorted(versions.get(name, []), key=lambda v: v.version),
                nodes=sorted(nodes.get(name, []), key=lambda s: s.node),
            )
            for name, alias in sorted(aliases.items())
        }

    # --- writing ---------------------------------------------------------------------------------
    async def add_version(self, draft: AdapterVersion, tenant: str | None = None) -> AdapterVersion:
        """Store the draft as the next version of its name; the number is taken from the alias by CAS. A tenant's
        registration claims a free name, and is refused under a name another tenant (or an admin) holds."""
        for _ in range(CAS_ATTEMPTS):
            alias, revision = await self.alias(draft.name)
            if alias is not None and tenant is not None and alias.tenant != tenant:
                raise RegistryError(
                    f"the adapter name {draft.name} belongs to another tenant; register under another name"
                )
            alias = alias or Alias(name=draft.name, tenant=tenant)
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

    async def change_alias(self, name: str, change, expect: int | None, expect_changes: int | None = None) -> Alias:
        """Apply change(alias) -> alias by compare-and-set; `expect` (0: none) is the current version the caller
        saw, `expect_changes` the alias's change count it saw, and the change is refused (Moved) if the alias
        moved since."""
        for _ in range(CAS_ATTEMPTS):
            alias, revision = await self.alias(name)
            if alias is None:
                raise RegistryError(f"no adapter named {name}; `jetlora adapters ls` lists them")
            if expect is not None and (alias.current or 0) != expect:
                raise Moved(
                    f"{name} serves {_at(alias)} now, not the expected "
                    f"{'no version' if not expect else f'{name}@{expect}'}: another change came first; "
                    "look again (`jetlora adapters show`) and repeat if still wanted"
                )
            if expect_changes is not None and alias.changes != expect_changes:
                raise Moved(
                    f"{name} changed since you looked (change {alias.changes} now, not {expect_changes}; it "
                    f"serves {_at(alias)}): look again (`jetlora adapters show`) and repeat if still wanted"
                )
            changed = msgspec.structs.replace(change(alias), updated=time.time(), changes=alias.changes + 1)
            if await self._put_alias(changed, revision):
                return changed
            if expect is not None or expect_changes is not None:
                alias, _ = await self.alias(name)
                raise Moved(
                    f"{name} changed while this change was made (it serves {_at(alias)} now); look again "
                    "and repeat if still wanted"
                )
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
