"""A tinker:// sampler path through the gateway's OpenAI-compatible routes, with the official `openai` client and the
caller's Tinker key, while its training client still runs: /v1/completions answers the text Tinker's own
SamplingClient samples greedily from the same prompt, /v1/chat/completions renders the chat with the base's chat
template (its usage counts those tokens) and streams the same text, and what is not the caller's or not served is
a 4xx naming the field."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.test_tinker_api import client, gateway, key_for  # noqa: F401  (gateway: the fixture)

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")
PROMPT = "What is the capital of France? "
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def drive(gw, key: str, other: str) -> dict:
    import openai
    from tinker import types

    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0)
    out: dict = {}
    with client(gw, key) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        tokenizer = tc.get_tokenizer()
        path = tc.save_weights_for_sampler("try-me").result().path
        sampler = sc.create_sampling_client(model_path=path).result()
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0)

        def tinker_text(tokens: list[int]) -> str:
            seq = sampler.sample(types.ModelInput.from_ints(tokens), 1, greedy).result().sequences[0]
            return tokenizer.decode(seq.tokens, skip_special_tokens=True)

        out["tinker"] = tinker_text(tokenizer.encode(PROMPT))
        completion = oai.completions.create(model=path, prompt=PROMPT, max_tokens=6, temperature=0)
        out["completion"] = completion.choices[0].text
        out["completion usage"] = (completion.usage.prompt_tokens, len(tokenizer.encode(PROMPT)))
        chat_tokens = tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
        chat_tokens = list(chat_tokens["input_ids"] if hasattr(chat_tokens, "keys") else chat_tokens)
        out["tinker chat"] = tinker_text(chat_tokens)
        chat = oai.chat.completions.create(model=path, messages=CHAT, max_tokens=6, temperature=0)
        out["chat"] = chat.choices[0].message.content
        out["chat usage"] = (chat.usage.prompt_tokens, len(chat_tokens), chat.choices[0].finish_reason)
        stream = oai.chat.completions.create(model=path, messages=CHAT, max_tokens=6, temperature=0, stream=True)
        out["streamed"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        several = oai.completions.create(model=path, prompt=PROMPT, max_tokens=4, n=2, seed=5)
        out["n"] = len(several.choices)

        def refused(call) -> tuple[int, str | None, str]:
            try:
                call()
            except openai.APIStatusError as e:
                body = e.body if isinstance(e.body, dict) else {}
                return e.status_code, body.get("param"), str(e)
            return 200, None, "accepted"

        stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=other, max_retries=0)
        out["refused"] = {
            "not tinker": refused(lambda: oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)),
            "logprobs": refused(lambda: oai.completions.create(model=path, prompt=PROMPT, max_tokens=2, logprobs=2)),
            "tools": refused(
                lambda: oai.chat.completions.create(
                    model=path, messages=CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]
                )
            ),  # fmt: skip
            "another's": refused(lambda: stranger.completions.create(model=path, prompt=PROMPT, max_tokens=2)),
            "no such save": refused(lambda: oai.completions.create(model=path + "x", prompt=PROMPT, max_tokens=2)),
        }
        tc.forward_backward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokenizer.encode(PROMPT)[:-1]),
                    loss_fn_inputs={"target_tokens": tokenizer.encode(PROMPT)[1:]},
                )
            ],
            "cross_entropy",
        ).result()  # fmt: skip  (its training goes on after)
    return out


async def test_a_sampler_path_answers_openai_completions_and_chat(nc, gateway):  # noqa: F811
    out = await asyncio.to_thread(drive, gateway, await key_for(nc, "acme"), await key_for(nc, "globex"))
    assert out["completion"] == out["tinker"], out  # greedy: the same tokens as Tinker's own sampler
    assert out["completion usage"][0] == out["completion usage"][1]
    assert out["chat"] == out["tinker chat"] and out["streamed"] == out["chat"], out
    assert out["chat usage"][0] == out["chat usage"][1] and out["chat usage"][2] in ("stop", "length")
    assert out["n"] == 2
    refused = out["refused"]
    assert refused["not tinker"][:2] == (404, "model") and "tinker://" in refused["not tinker"][2], refused
    assert refused["logprobs"][:2] == (400, "logprobs"), refused
    assert refused["tools"][:2] == (400, "tools"), refused
    assert refused["another's"][0] == 404 and refused["no such save"][0] == 404, refused
