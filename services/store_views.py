"""LatestViews of the two kinds of store services keep in JetStream: a KV bucket's current keys and an object
store's current objects (services/streamview.py holds the view itself)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nats.js.api import ObjectInfo

from schemas import nats_subjects
from services.streamview import Grouping, LatestView, Pace, Slice

KV_OPERATION = "KV-Operation"  # the header a KV delete or purge carries


def kv_view(
    js,
    bucket: str,
    decode: Callable[[str, bytes], Any],
    grouping: Grouping | None = None,
    catch_up_s: float = Pace.catch_up_s,
    heartbeat_s: float = Pace.heartbeat_s,
) -> LatestView:
    """A KV bucket's current keys, decode(key, value) each; deleted and purged keys are absent."""

    def value(key: str, msg) -> Any | None:
        if (msg.headers or {}).get(KV_OPERATION) in ("DEL", "PURGE") or not msg.data:
            return None
        return decode(key, msg.data)

    return LatestView(js, kv_slice(bucket), value, grouping, Pace(catch_up_s, heartbeat_s))


def kv_slice(bucket: str) -> Slice:
    """Every key of a KV bucket, as its stream holds them."""
    store = nats_subjects.kv(bucket)
    return Slice(store.stream, store.subjects, store.prefix)


def object_view(js, bucket: str, pace: Pace = Pace()) -> LatestView:
    """An object store's current objects as nats-py ObjectInfo, by name; deleted ones are absent."""

    def info(_key: str, msg) -> ObjectInfo | None:
        found = ObjectInfo.from_response(json.loads(msg.data))
        return None if found.deleted else found

    store = nats_subjects.objects(bucket)
    return LatestView(js, Slice(store.stream, store.metas), info, pace=pace)
