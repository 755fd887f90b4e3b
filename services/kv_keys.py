"""The keys of a KV bucket, listed by the stream that holds it rather than by nats-py's `KeyValue.keys()`.

`keys()` watches the bucket and stops at its first "nothing pending" marker, which it puts in the queue when the
consumer's info says nothing is pending and its callback has not yet counted a message. On a busy machine the server
has often pushed every message (nothing pending) before the callback ran, so the marker comes first and `keys()`
answers an empty bucket (NoKeysError) while it holds keys: a list of runs or keys that silently comes back empty.
The stream's own subject counts (STREAM.INFO with a subjects filter, paged) have no such race. A key whose last
write is a delete or purge is listed too: its reader's `get` says it is gone."""

from __future__ import annotations

import json

from nats.js.kv import KeyValue

from schemas import nats_subjects

PAGE_TIMEOUT_S = 5.0


async def kv_keys(kv: KeyValue, prefix: str = "") -> list[str]:
    """Every key of the bucket `kv` opens beginning with `prefix` (sorted), deleted ones included."""
    store = nats_subjects.kv(kv._name)  # nats-py keeps the bucket's name and its context unexported
    nc = kv._js._nc
    tokens = prefix if prefix.endswith(".") else ""  # whole tokens filter on the server; the rest of it here
    subjects: dict[str, int] = {}
    while True:
        request: dict = {"subjects_filter": f"{store.prefix}{tokens}>"}
        if subjects:
            request["offset"] = len(subjects)
        subject = nats_subjects.js_api("STREAM", "INFO", store.stream)
        reply = await nc.request(subject, json.dumps(request).encode(), PAGE_TIMEOUT_S)
        info = json.loads(reply.data)
        if "error" in info:
            raise RuntimeError(f"listing bucket {kv._name}'s keys: {info['error'].get('description', info['error'])}")
        page = info.get("state", {}).get("subjects") or {}
        before = len(subjects)
        subjects.update(page)
        if len(subjects) >= info.get("total", 0) or len(subjects) == before:
            break
    keys = (s[len(store.prefix) :] for s in subjects)
    return sorted(k for k in keys if k.startswith(prefix))
