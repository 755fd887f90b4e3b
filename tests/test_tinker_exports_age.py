"""weights.download of a state (tinker://.../weights/...) exports it with save_weights_external to an age recipient
the cookbook generates, then fetches and decrypts each file (pyrage). With the official client: an export made with
age_encryption_recipients lists its files as NAME.age, each opens only with its signed URL, and decrypted by an
identity of the recipients (and no other) is byte for byte the file the same state exports unencrypted."""

from __future__ import annotations

import asyncio
import os
import urllib.request

import pytest

from tests.test_tinker_api import client, datums, gateway, key_for  # noqa: F401  (gateway: the fixture)

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")


def exports(gw, key: str, recipients: list[str]) -> dict:
    import tinker
    from tinker import types

    with client(gw, key) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        batch, _ = datums(tc.get_tokenizer(), types)
        tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        plain = tc.save_weights_external("plain").result().path
        sealed = tc.save_weights_external("sealed", ttl_seconds=3600, age_encryption_recipients=recipients)
        sealed_path = sealed.result().path
        rest = tinker.RestClient(base_url=f"http://127.0.0.1:{gw.port}", api_key=key)
        out = {}
        for name, path in (("plain", plain), ("sealed", sealed_path)):
            urls = rest.get_external_weights_urls(path).result().urls
            out[name] = {file: urllib.request.urlopen(link).read() for file, link in urls.items()}
        return out


async def test_an_export_to_age_recipients_decrypts_to_the_plain_files(nc, gateway, tmp_path):  # noqa: F811
    import pyrage

    mine, other = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    recipients = [str(mine.to_public()), str(pyrage.x25519.Identity.generate().to_public())]
    out = await asyncio.to_thread(exports, gateway, await key_for(nc, "acme"), recipients)
    plain, sealed = out["plain"], out["sealed"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(plain), sorted(plain)
    assert sorted(sealed) == sorted(f + ".age" for f in plain), sorted(sealed)
    for name, data in plain.items():
        encrypted = sealed[name + ".age"]
        assert encrypted.startswith(b"age-encryption.org/v1\n") and data not in encrypted
        assert pyrage.decrypt(encrypted, [mine]) == data, name
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(encrypted, [other])
