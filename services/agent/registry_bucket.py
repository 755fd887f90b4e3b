"""The agent's reads and writes of the adapter registry's bucket, through its stored format (schemas/registry.py,
names.adapter_*_key): a version by its key, and this node's own statuses (the only keys its permissions let it
write). Nothing of the registry service's own code."""

from __future__ import annotations

import msgspec
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from schemas import names
from schemas.registry import DECODERS, AdapterVersion, NodeAdapterStatus

_enc = msgspec.json.Encoder()


class RegistryBucket:
    """The registry's bucket as one agent reads and writes it."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def version(self, name: str, version: int) -> AdapterVersion | None:
        """NAME@N as registered (versions are written once); None when there is no such version."""
        try:
            entry = await self.kv.get(names.adapter_version_key(name, version))
        except KeyNotFoundError:
            return None
        return DECODERS["version"].decode(entry.value or b"")

    async def put_node_status(self, status: NodeAdapterStatus) -> None:
        """What one of this node's engines did with an adapter, under `node.<name>.<node>`."""
        await self.kv.put(names.adapter_node_key(status.name, status.node), _enc.encode(status))
