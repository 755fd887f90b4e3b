"""NATS's own subjects, which jetlora's permissions and its writers and readers below nats-py name: JetStream's API,
the stream behind a KV bucket or an object store and its entries' subjects, a user's inbox, nats.micro's discovery.
jetlora's own subjects, streams and buckets are schemas/names.py."""

from __future__ import annotations

import base64
from dataclasses import dataclass

JS_API_ALL = "$JS.API.>"


def inbox(user: str) -> str:
    """A user's own inbox prefix: the replies to its requests arrive under it, and only it may subscribe there."""
    return f"_INBOX.{user}"


def inbox_all(user: str) -> str:
    return inbox(user) + ".>"


SERVICE_DISCOVERY_ALL = "$SRV.>"


def service_discovery(service: str) -> list[str]:
    """What a nats.micro service of that name listens on to be discovered ($SRV.PING, INFO and STATS: asked of every
    service, of its name, of one instance), and nothing of another service's: what its user may subscribe to."""
    return [f"$SRV.{verb}{of}" for verb in ("PING", "INFO", "STATS") for of in ("", f".{service}", f".{service}.*")]


def service_stats(service: str) -> str:
    """nats.micro's statistics of one service (every instance answers): requests and errors per endpoint."""
    return f"$SRV.STATS.{service}"


def js_api(*parts: str) -> str:
    return ".".join(("$JS.API",) + parts)


@dataclass(frozen=True)
class StoreNames:
    """The stream behind a KV bucket or an object store, and the subjects its entries live on."""

    stream: str
    prefix: str  # what precedes a key (KV) or "C.<nuid>" / "M.<name>" (object store) in a subject

    @property
    def subjects(self) -> str:
        return self.prefix + ">"

    @property
    def metas(self) -> str:
        """An object store's descriptions of all its objects."""
        return self.prefix + "M.>"

    def chunks(self, nuid: str) -> str:
        """An object store's chunks of one object."""
        return f"{self.prefix}C.{nuid}"

    def meta(self, name: str) -> str:
        """An object store's description of one object (publishing it makes the object visible)."""
        return f"{self.prefix}M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def kv(bucket: str) -> StoreNames:
    return StoreNames(stream=f"KV_{bucket}", prefix=f"$KV.{bucket}.")


def objects(bucket: str) -> StoreNames:
    return StoreNames(stream=f"OBJ_{bucket}", prefix=f"$O.{bucket}.")


def js_acks(stream: str) -> str:
    return f"$JS.ACK.{stream}.>"
