"""API keys: each maps to one tenant. Stored as the sha256 of the secret, shown to the operator once."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

import msgspec
from nats.js.errors import KeyNotFoundError

from schemas import names
from schemas.gateway import KeyRecord
from services.kv_keys import kv_keys

PREFIX = "jl"


def new_key(tenant: str, label: str = "") -> tuple[str, KeyRecord]:
    """A fresh key (`jl-<id>-<secret>`) and the record that stores it hashed."""
    names.check_tenant(tenant)
    ident, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    return f"{PREFIX}-{ident}-{secret}", KeyRecord(
        id=ident, tenant=tenant, secret_sha256=_digest(secret), created=time.time(), label=label
    )


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    """The keys bucket, read by the gateway and written by `jetlora keys`."""

    def __init__(self, kv) -> None:
        self.kv = kv
        self._decode = msgspec.json.Decoder(KeyRecord).decode

    @classmethod
    async def open(cls, js) -> "KeyStore":
        return cls(await js.key_value(names.KEYS_KV))

    async def put(self, record: KeyRecord) -> None:
        await self.kv.put(record.id, msgspec.json.encode(record))

    async def records(self) -> list[KeyRecord]:
        keys = await kv_keys(self.kv)
        return [r for r in [await self._get(k) for k in keys] if r is not None]

    async def delete(self, ident: str) -> bool:
        if await self._get(ident) is None:
            return False
        await self.kv.purge(ident)
        return True

    async def _get(self, ident: str) -> KeyRecord | None:
        try:
            entry = await self.kv.get(ident)
        except KeyNotFoundError:
            return None
        return self._decode(entry.value) if entry.value else None

    async def record(self, ident: str) -> KeyRecord | None:
        """A key's record by its id (what a URL signed for that key names)."""
        return await self._get(ident) if len(ident) == 16 and all(c in "0123456789abcdef" for c in ident) else None

    async def tenant_of(self, key: str) -> str | None:
        """The tenant of a presented key; None for anything that is not a stored key."""
        prefix, _, rest = key.partition("-")
        ident, _, secret = rest.partition("-")
        if prefix != PREFIX or len(ident) != 16 or not secret or not all(c in "0123456789abcdef" for c in ident):
            return None
        record = await self._get(ident)
        if record is None or not hmac.compare_digest(record.secret_sha256, _digest(secret)):
            return None
        return record.tenant
