"""Every read and write the registry makes of its KV bucket (a stored format: schemas/registry.py). Versions are
created, never overwritten; an alias changes only by compare-and-set on the revision it was read at, so concurrent
changes cannot interleave."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from schemas import names, nats_subjects
from schemas.registry import (
    DECODERS,
    AdapterReply,
    AdapterVersion,
    Alias,
    JobReferences,
    NodeAdapterStatus,
    adapter_of,
    adapter_subjects,
)
from services.store_views import KV_OPERATION, kv_slice
from services.streamview import Grouping, LatestView

log = logging.getLogger(__name__)

_version, _alias = DECODERS["version"], DECODERS["alias"]
_enc = msgspec.json.Encoder()
CAS_ATTEMPTS = 20


class RegistryError(Exception):
    """A change the registry refuses: what is wrong and what to do."""


class Moved(RegistryError):
    """The alias is not where the caller expected: another change came first."""


def registry_view(js) -> LatestView:
    """Every alias, version and node status of the registry, decoded, kept current by one consumer and indexed by
    adapter name, so that one adapter is read without walking (or asking the stream about) the others. A node
    status carries the bucket sequence it was stored at (`seq`), and one whose payload names another adapter or
    node than its key is left out: the key is what a node's permissions let it write (`node.*.<node>`)."""

    def value(key: str, msg) -> object | None:
        if (msg.headers or {}).get(KV_OPERATION) in ("DEL", "PURGE") or not msg.data:
            return None
        kind = key.partition(".")[0]
        decoded = DECODERS[kind].decode(msg.data)
        return _as_stored(key, decoded, msg.metadata.sequence.stream) if kind == "node" else decoded

    return LatestView(js, kv_slice(names.ADAPTERS_KV), value, Grouping(adapter_of, adapter_subjects))


def _as_stored(key: str, status: NodeAdapterStatus, seq: int) -> NodeAdapterStatus | None:
    """The status as the registry counts it: stamped with its sequence, or None when it speaks for another key."""
    _, name, node = key.split(".", 2)
    if status.name != name or status.node != node:
        log.warning(
            "registry: %s holds a status of %s on node %s, not its own; it is not counted (an agent reports "
            "only under node.<name>.<its node>)",
            key,
            status.name,
            status.node,
        )
        return None
    return msgspec.structs.replace(status, seq=seq)


class AdapterRegistry:
    """Reads one key by a direct lookup; reads that span keys (aliases, versions, node statuses) come from `view`,
    which only a service that answers them runs (the registry service)."""

    def __init__(self, kv, view: LatestView | None = None, js=None) -> None:
        self.kv, self.view, self.js = kv, view, js  # js: the registry service's, for what a KV handle cannot do

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

    async def references(self, jobs: list[str]) -> list[JobReferences]:
        """The versions, and their artifacts, made of each of `jobs` (those no version is made of are left out)."""
        if self.view is None:
            raise RuntimeError("this AdapterRegistry has no view: only the registry service reads references")
        wanted = set(jobs)
        found: dict[str, JobReferences] = {}
        for key, value in (await self.view.snapshot()).items():
            if key.startswith("version.") and value.job in wanted:
                ref = found.setdefault(value.job, JobReferences(job=value.job, versions=[], artifacts=[]))
                ref.versions.append(f"{value.name}@{value.version}")
                ref.artifacts += [
                    f.name for f in (value.peft, value.gguf) if f is not None and f.name not in ref.artifacts
                ]
        return [found[job] for job in sorted(found)]

    async def newest_seq(self) -> int:
        """The bucket's newest stream sequence (0: empty): what a canary counts reports after."""
        store = nats_subjects.kv(names.ADAPTERS_KV)
        try:
            return (await self.js.get_msg(store.stream, subject=store.subjects)).seq or 0
        except NotFoundError:
            return 0

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

    async def note_alias(self, name: str, change) -> Alias | None:
        """Apply change(alias) -> alias | None by compare-and-set without counting a change of what it serves (a
        gate's progress, or its refusal); None (from `change` too): nothing written."""
        for _ in range(CAS_ATTEMPTS):
            alias, revision = await self.alias(name)
            if alias is None or (changed := change(alias)) is None:
                return None
            if await self._put_alias(msgspec.structs.replace(changed, updated=time.time()), revision):
                return changed
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

    async def forget_node_status(self, key: str) -> int:
        """Remove a node status with every revision of it (a purge: views drop the key); returns the sequence of
        the purge marker the bucket keeps in its place, for drop_marker."""
        store = nats_subjects.kv(names.ADAPTERS_KV)
        ack = await self.js.publish(store.prefix + key, b"", headers={KV_OPERATION: "PURGE", "Nats-Rollup": "sub"})
        return ack.seq

    async def drop_marker(self, key: str, seq: int) -> bool:
        """Remove the purge marker at `seq` (and nothing written to the key after it), once the bucket holds a newer
        message: a view checks that the stream's newest message never goes back. False: not yet."""
        store = nats_subjects.kv(names.ADAPTERS_KV)
        if await self.newest_seq() <= seq:
            return False
        await self.js.purge_stream(store.stream, subject=store.prefix + key, seq=seq + 1)
        return True


def _at(alias: Alias | None) -> str:
    if alias is None or alias.current is None:
        return "no version"
    return f"{alias.name}@{alias.current}"
