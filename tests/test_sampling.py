"""trainer/objectives/sampling.py's lean decode loop samples exactly the tokens transformers' generate() samples from the same
random state (plain sampling at 0.7 and 1.0, greedy), on the tiny model with a LoRA adapter on, prompts of different
lengths left-padded; rows that ended are padded and it stops once every row has; and anything it does not do as
generate does falls back to generate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from tests.qa import QA_PAIRS
from tests.test_grpo_vs_trl import adapted
from trainer.objectives import sampling
from trainer.objectives.rollouts import NO_PENALTIES, PLAIN_GREEDY, PLAIN_SAMPLING, eos_ids, evaluating, pad_id

MAX_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: small matmuls on a loaded machine run far slower on several (both sides alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def peft_model(tiny_model):
    tok, model, _ = adapted(str(tiny_model))
    return tok, model


def batch(tok, rows_per_prompt: int = 4):
    """Three questions of different lengths, each `rows_per_prompt` times, left-padded: (ids, mask)."""
    questions = sorted({q for q, _ in QA_PAIRS}, key=len)
    chosen = [questions[0], questions[len(questions) // 2], questions[-1]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in chosen]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    assert len({len(p) for p in prompts}) > 1
    width = max(map(len, prompts))
    ids = torch.full((len(prompts) * rows_per_prompt, width), pad_id(tok))
    mask = torch.zeros_like(ids)
    for n, p in enumerate(p for p in prompts for _ in range(rows_per_prompt)):
        ids[n, width - len(p) :], mask[n, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


def config(tok, model, temperature, eos=None) -> GenerationConfig:
    how = dict(PLAIN_SAMPLING, temperature=temperature) if temperature is not None else PLAIN_GREEDY
    eos = eos_ids(model, tok) if eos is None else eos
    return GenerationConfig(
        max_new_tokens=MAX_TOKENS, pad_token_id=pad_id(tok), eos_token_id=eos, **how, **NO_PENALTIES
    )


def both(model, ids, mask, cfg, seed: int):
    """(generate's output, sample()'s), each from `seed`; sample() must not call generate."""
    with evaluating(model):
        torch.manual_seed(seed)
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        generate, model.generate = model.generate, None  # the lean loop only
        try:
            torch.manual_seed(seed)
            got = sampling.sample(model, ids, mask, cfg)
        finally:
            del model.generate
    assert generate is not None
    return expected, got


@pytest.mark.parametrize("temperature", [0.7, 1.0, None])
def test_lean_loop_samples_generates_tokens(peft_model, temperature):
    tok, model = peft_model
    ids, mask = batch(tok)
    cfg = config(tok, model, temperature)
    assert sampling.lean_ok(model, cfg)
    for seed in range(3):
        expected, got = both(model, ids, mask, cfg, seed)
        assert torch.equal(got, expected), (seed, got, expected)


def test_rows_that_ended_are_padded_and_it_stops_when_all_have(peft_model):
    tok, model = peft_model
    ids, mask = batch(tok)
    with evaluating(model):  # greedy's first and second tokens, so that eos ends each row at one of them
        first = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(tok, model, None))
    width = ids.shape[1]
    ends = sorted({int(first[0, width]), *(int(t) for t in first[1:, width + 1])} - {pad_id(tok)})
    expected, got = both(model, ids, mask, config(tok, model, None, eos=ends), 0)
    assert torch.equal(got, expected)
    assert got.shape[1] <= width + 2  # stopped once every row had ended
    row_zero = got[0, width:]
    assert row_zero[0] in ends and (row_zero[1:] == pad_id(tok)).all()


def test_merged_settings_it_does_not_do_fall_back_to_generate(peft_model, monkeypatch):
    tok, model = peft_model
    ids, mask = batch(tok)
    cfg = config(tok, model, 0.7)
    for setting, value in [("suppress_tokens", [5]), ("min_new_tokens", 3), ("cache_implementation", "static")]:
        monkeypatch.setattr(model.generation_config, setting, value)
        assert not sampling.lean_ok(model, cfg), setting
        monkeypatch.undo()
    assert not sampling.lean_ok(model, GenerationConfig(**{**cfg.to_dict(), "top_k": 50}))
    monkeypatch.setattr(sampling, "LEAN", False)
    with evaluating(model):
        torch.manual_seed(0)
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        torch.manual_seed(0)
        assert torch.equal(sampling.sample(model, ids, mask, cfg), expected)


def test_a_cache_other_than_dynamic_falls_back_before_any_draw(peft_model, monkeypatch):
    tok, model = peft_model
    ids, mask = batch(tok)
    cfg = config(tok, model, 0.7)
    monkeypatch.setattr(sampling, "DynamicCache", type("Other", (), {}))  # the model's cache is no longer "plain"
    with evaluating(model):
        assert sampling.lean(model, ids, mask, cfg) is None
        torch.manual_seed(0)
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        torch.manual_seed(0)
        assert torch.equal(sampling.sample(model, ids, mask, cfg), expected)


def test_models_it_does_not_know_fall_back():
    assert not sampling.full_attention(SimpleNamespace(layer_types=["full_attention", "sliding_attention"]))
    assert not sampling.full_attention(SimpleNamespace(layer_types=["linear_attention"]))
    assert not sampling.full_attention(SimpleNamespace(sliding_window=4096))
    assert sampling.full_attention(SimpleNamespace(sliding_window=4096, use_sliding_window=False))
    assert not sampling.plain_lora(SimpleNamespace(peft_config={"default": SimpleNamespace(peft_type="PROMPT_TUNING")}))
    assert not sampling.lean_ok(SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=True)), GenerationConfig())
    assert sampling.quantised(SimpleNamespace(hf_quantizer=object()))


def test_lean_lora_layers_are_restored_and_skip_what_is_not_plain(peft_model):
    from peft.tuners.lora.layer import Linear as LoraLinear

    _, model = peft_model
    layers = [m for m in model.modules() if type(m) is LoraLinear]
    with evaluating(model), sampling.lean_lora(model):
        assert all("forward" in m.__dict__ for m in layers)
    assert not any("forward" in m.__dict__ for m in layers)
    model.train()
    with sampling.lean_lora(model):  # dropout on: peft's own forward
        assert not any("forward" in m.__dict__ for m in layers)
