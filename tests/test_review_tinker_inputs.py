"""Review of #63's new routes with inputs a client should not send: each is a 4xx naming what to change, never a
5xx (which the official client retries for five minutes, and which left a forward_backward's turn untaken so the
model's later calls waited). A stable_reinforce datum naming a sequence id asample never gave out; a signed export
URL whose expiry is not ASCII digits; OpenAI's stream_options that is not an object; and the sampler saves' bound,
which a save named again without its TTL escaped once that TTL had passed (its place kept the old expiry)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request

import pytest

from schemas.tinker_store import Holds, holds_key
from services.gateway.tinker.bounds import Bounds
from services.gateway.tinker.http import TinkerRefusal
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from tests.test_tinker_api import client, gateway, key_for  # noqa: F401  (gateway: the fixture)

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")
BAD_SEQUENCES = ("not an id-0-1", "sess-1:s:ab-\u00b2-1", "a.b*-0-1")


def status(url: str, body: bytes | None = None, key: str = "") -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body else {})
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode(errors="replace")[:20000]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:400]


def drive(gw, key: str) -> dict:
    import tinker
    from tinker import types

    out: dict = {"sequences": {}}
    with client(gw, key) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        tokens = tc.get_tokenizer().encode("What is the capital of France? Paris")
        for ident in BAD_SEQUENCES:
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "advantages": [1.0] * (len(tokens) - 1)},
            ).with_provenance(
                model_input=[types.SampledProvenanceSpan(sequence_id=ident, length=len(tokens) - 1)],
                loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id=ident, length=len(tokens) - 1)],
            )
            try:  # a 5xx is retried for minutes: past 90 s it is one
                tc.forward_backward([datum], "stable_reinforce").result(timeout=90)
                out["sequences"][ident] = "accepted"
            except tinker.BadRequestError as e:
                out["sequences"][ident] = str(e)
            except Exception as e:  # noqa: BLE001  (what the test reports)
                out["sequences"][ident] = f"{type(e).__name__}: {e}"
        plain = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})  # fmt: skip
        out["after"] = tc.forward([plain], "cross_entropy").result(timeout=120).metrics["loss:sum"]  # turns go on
        path = tc.save_weights_for_sampler("review").result().path
        url = f"http://127.0.0.1:{gw.port}/v1/completions"
        for options in ("yes", [1], {"include_usage": "sure"}):
            body = {"model": path, "prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": options}
            out[f"stream_options {options!r}"] = status(url, json.dumps(body).encode(), key)
        ok = {"model": path, "prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        out["stream_options ok"] = status(url, json.dumps(ok).encode(), key)
    return out


async def test_bad_provenance_and_stream_options_are_4xx_and_the_turns_go_on(nc, gateway):  # noqa: F811
    out = await asyncio.to_thread(drive, gateway, await key_for(nc, "acme"))
    for ident in BAD_SEQUENCES:
        assert "sequence_id" in out["sequences"][ident] and "asample" in out["sequences"][ident], out
    assert out["after"] > 0, out
    for options in ("yes", [1], {"include_usage": "sure"}):
        code, text = out[f"stream_options {options!r}"]
        assert code == 400 and "stream_options" in text, (options, code, text)
    code, text = out["stream_options ok"]
    assert code == 200 and "usage" in text and "[DONE]" in text, (code, text)


async def test_an_export_url_with_an_expiry_not_in_ascii_digits_is_refused(nc, gateway):  # noqa: F811
    key = await key_for(nc, "acme")
    ident = key.removeprefix("tml-").split("-", 2)[1]
    base = f"http://127.0.0.1:{gateway.port}/api/v1/external_weights/sess-1:train:0/_export-x/adapter_config.json"
    for expires in ("%C2%B2", "9" * 5000, "-1", ""):
        code, text = await asyncio.to_thread(status, f"{base}?key={ident}&expires={expires}&sig=00")
        assert code == 403 and "get_external_weights_urls" in text, (expires[:20], code, text)


async def test_a_save_named_again_without_its_passed_ttl_counts_against_the_bound(stack, nc):
    store = await Store(nc).open()
    bounds = Bounds(store, TinkerSettings(max_sampler_saves=2))
    path = "tinker://sess-1:train:0/sampler_weights/{}"
    passed = time.time() - 1  # a TTL that passed, its save not swept yet (every 300 s)
    await bounds.sampler_save("acme", "sess-1", path.format("a"), "r1", passed)
    await bounds.sampler_save("acme", "sess-1", path.format("a"), "r2", None)  # saved again, kept for good
    await bounds.sampler_save("acme", "sess-1", path.format("b"), "r3", None)
    with pytest.raises(TinkerRefusal) as refused:
        await bounds.sampler_save("acme", "sess-1", path.format("c"), "r4", None)  # a and b hold both places
    assert refused.value.status == 400 and "max_sampler_saves" in refused.value.detail
    later = time.time() + 3600
    await bounds.sampler_save("acme", "sess-1", path.format("b"), "r5", later)  # b saved again with a TTL
    held = await store.get(store.kv, holds_key("acme", "samplers"), Holds)
    assert held is not None and {h.id[-1]: h.expires for h in held[0].held} == {"a": None, "b": later}, held
