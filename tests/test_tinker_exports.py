"""save_weights_external with the official client: the export is listed with its run's checkpoints (type external),
get_external_weights_urls gives one URL per PEFT file, each fetched with a plain GET as the cookbook's
weights.download does; the files load in PEFT and give the log-probs the session's forward gave. A URL whose
signature is altered, or that another tenant asks for, opens nothing; age encryption is refused by name."""

from __future__ import annotations

import asyncio
import os
import re
import urllib.error
import urllib.request

import pytest
import torch

from tests.test_tinker_api import client, datums, gateway, key_for  # noqa: F401  (gateway: the fixture)

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")


def export(gw, key: str, other: str, into) -> dict:
    import tinker
    from tinker import types

    url = f"http://127.0.0.1:{gw.port}"
    with client(gw, key) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        batch, _ = datums(tc.get_tokenizer(), types)
        for _ in range(3):
            tc.forward_backward(batch, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        path = tc.save_weights_external("final").result().path
        forward = tc.forward(batch[:2], "cross_entropy").result()
        rest = tinker.RestClient(base_url=url, api_key=key)
        listed = {c.tinker_path: c.checkpoint_type for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        urls = rest.get_external_weights_urls(path).result().urls
        for name, link in urls.items():
            urllib.request.urlretrieve(link, str(into / name))  # no header: the URL alone opens it

        def status(link: str) -> int:
            try:
                return urllib.request.urlopen(link).status
            except urllib.error.HTTPError as e:
                return e.code

        link = urls["adapter_model.safetensors"]
        stranger = tinker.RestClient(base_url=url, api_key=other)
        try:
            stranger.get_external_weights_urls(path).result()
            strangers = "answered"
        except tinker.NotFoundError:
            strangers = "not found"
        try:
            tc.save_weights_external("sealed", age_encryption_recipients=["age1qqqq"]).result()
            age = "accepted"
        except tinker.BadRequestError as e:
            age = str(e)
        return {
            "path": path,
            "model": tc.model_id,
            "listed": listed,
            "files": sorted(urls),
            "tampered": status(link[:-4] + ("0000" if not link.endswith("0000") else "1111")),
            "redated": status(re.sub(r"expires=\d+", "expires=4102444800", link)),  # a later end: not signed
            "strangers": strangers,
            "age": age,
            "batch": [(d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist()) for d in batch[:2]],
            "logprobs": [o["logprobs"].tolist() for o in forward.loss_fn_outputs],
        }


async def test_an_export_downloads_by_signed_urls_and_loads_in_peft(nc, gateway, tiny_model, tmp_path):  # noqa: F811
    keys = await key_for(nc, "acme"), await key_for(nc, "globex")
    out = await asyncio.to_thread(export, gateway, *keys, tmp_path)
    assert out["path"] == f"tinker://{out['model']}/external_weights/final"
    assert out["listed"][out["path"]] == "external", out["listed"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(out["files"]), out["files"]
    assert out["tampered"] == 403 and out["redated"] == 403 and out["strangers"] == "not found", out
    assert "age_encryption_recipients" in out["age"], out["age"]

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(tmp_path)).eval()
    for (tokens, targets), expected in zip(out["batch"], out["logprobs"]):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits.float()
        got = torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(targets).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(got, torch.tensor(expected), atol=1e-4), (got, expected)


def test_a_signed_urls_expiry_is_ascii_digits_of_a_plausible_time():
    import time

    from services.gateway.tinker.exports import _timestamp

    assert _timestamp(str(int(time.time()) + 3600))
    for bad in ("\u00b2", "9" * 5000, "-1", "", "1e9", " 12"):  # int() of these raises, or is no time: a 403
        assert not _timestamp(bad), bad
