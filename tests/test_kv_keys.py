"""services/kv_keys.py against a real nats-server: a bucket's keys by prefix, from the stream's own subject counts
(nats-py's `keys()` can answer an empty bucket on a busy machine: its "nothing pending" marker may come before the
messages it counts)."""

from __future__ import annotations

from services.kv_keys import kv_keys


async def test_a_buckets_keys_are_listed_by_prefix_whole_tokens_or_not(nc):
    kv = await nc.jetstream().create_key_value(bucket="kvkeys")
    try:
        assert await kv_keys(kv) == []  # an empty bucket is an empty list, not an error
        for key in ("run.acme.r2", "run.acme.r1", "run.globex.r3", "eval._.capq", "runner"):
            await kv.put(key, b"{}")
        await kv.put("run.acme.r1", b"{}")  # a key written twice is listed once
        await kv.delete("run.globex.r3")  # listed still: its reader's get says it is gone
        assert await kv_keys(kv, "run.") == ["run.acme.r1", "run.acme.r2", "run.globex.r3"]
        assert await kv_keys(kv, "run.acme.") == ["run.acme.r1", "run.acme.r2"]
        assert await kv_keys(kv, "run") == ["run.acme.r1", "run.acme.r2", "run.globex.r3", "runner"]
        assert len(await kv_keys(kv)) == 5
    finally:
        await nc.jetstream().delete_key_value("kvkeys")
