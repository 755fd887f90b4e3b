"""A lean decode loop for grpo's rollouts and greedy evals: the tokens transformers' generate() samples, without its
per-call set-up and per-token bookkeeping (on the tiny model of bench/rl.py a rollout takes about 0.7x generate's).

It does what generate's own loop does for plain sampling (logits / temperature, softmax, one multinomial draw per
row per token, every row drawn every token: the same random stream) and for greedy (argmax): the prompt in one
forward pass (position ids counted from each row's first real token, only the last position's logits), then a token
at a time through the model's DynamicCache, the attention mask growing by ones, a row that has ended fed `pad` until
every row has ended or `max_new_tokens` are out. Same model, same forward, same arithmetic, so the same tokens; it
runs under inference_mode (no autograd bookkeeping) with each plain LoRA layer's forward computed directly
(lean_lora: the same matmuls and sums peft's forward makes, less its per-call checks).

Anything generate would do otherwise falls back to generate itself, decided before the first draw so the random
stream is untouched: an encoder-decoder or a model that prepares its own generation inputs (multimodal, remote
code, recurrent or hybrid state), a layer that is not full attention (sliding windows, linear attention), a
quantised base, a peft adapter other than plain LoRA (prompt learning, activated LoRA), a cache that comes back
other than a plain DynamicCache, and any generation setting, the model's generation_config's included, that would
add a logits processor or stopping criterion (suppressed tokens, minimum lengths, forced tokens, stop strings...).
The cache's keyword has changed names across transformers versions (past_key_values, then cache): the forward's
own signature says which.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationConfig
from transformers.generation.utils import GenerationMixin

from trainer.model import base_of

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig

    from trainer.model import CausalLM

LEAN = True  # False: always generate (bench/rl.py's --sampler generate, to measure the loop against it)
ANY = None  # a setting the loop need not look at: beam search's, assisted decoding's, bookkeeping
# every setting generate's merged config may differ from GenerationConfig() in, and the values it may take
NEUTRAL: dict[str, tuple[object, ...] | None] = {
    **dict.fromkeys(("max_length", "early_stopping", "length_penalty", "num_assistant_tokens"), ANY),
    **dict.fromkeys(("num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind"), ANY),
    **dict.fromkeys(("target_lookbehind", "_from_model_config", "transformers_version", "bos_token_id"), ANY),
    **dict.fromkeys(("max_new_tokens", "pad_token_id", "eos_token_id", "do_sample", "temperature"), ANY),  # ours
    **dict.fromkeys(("num_beams", "num_return_sequences", "num_beam_groups"), (1, None)),
    **dict.fromkeys(("repetition_penalty", "encoder_repetition_penalty"), (1.0, None)),
    **dict.fromkeys(
        ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "min_length", "min_new_tokens"), (0, None)
    ),
    **dict.fromkeys(("output_attentions", "output_hidden_states", "output_scores", "output_logits"), (False, None)),
    **dict.fromkeys(("return_dict_in_generate", "remove_invalid_values", "renormalize_logits"), (False, None)),
    "diversity_penalty": (0.0, None),
    "use_cache": (True, None),
    "cache_implementation": (None, "dynamic"),
}
WARPERS: dict[str, tuple[object, ...] | None] = {  # sampling's
    "top_k": (0, None),
    "top_p": (1.0, None),
    "min_p": (0.0, None),
    "typical_p": (1.0, None),
}
WARPERS |= {"epsilon_cutoff": (0.0, None), "eta_cutoff": (0.0, None)}


def sample(
    model: CausalLM | PeftModel, ids: torch.Tensor, mask: torch.Tensor, config: GenerationConfig
) -> torch.Tensor:
    """generate(input_ids=ids, attention_mask=mask, generation_config=config)'s output: the prompts and their
    completions, [rows, prompt width + completion width]."""
    if LEAN and lean_ok(model, config):
        with lean_lora(model), torch.inference_mode():
            out = lean(model, ids, mask, config)
        if out is not None:
            return out.clone()  # a plain tensor again: the loss's forward keeps the ids for its backward
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


def lean_ok(model: CausalLM | PeftModel, config: GenerationConfig) -> bool:
    """Whether the lean loop would do just what generate does with this model and config (see the module's
    docstring); anything unrecognised says no."""
    base = base_of(model)
    cfg = getattr(base, "config", None)
    if cfg is None or getattr(cfg, "is_encoder_decoder", True) or not type(base).__module__.startswith("transformers."):
        return False
    kind = type(base)
    for hook in ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation", "_sample"):
        if getattr(kind, hook, None) is not getattr(GenerationMixin, hook, None):
            return False
    supports = getattr(base, "_supports_default_dynamic_cache", None)
    if supports is None or not supports() or quantised(base) or not full_attention(cfg):
        return False
    if "logits_to_keep" not in inspect.signature(base.forward).parameters or cache_keyword(base) is None:
        return False
    return plain_lora(model) and settings_ok(model, config)


def plain_lora(model: CausalLM | PeftModel) -> bool:
    """No adapter, or LoRA adapters that are only layers of the forward: not prompt learning (virtual tokens) nor
    activated LoRA (offsets peft's generate computes), which peft's own generate handles."""
    configs = getattr(model, "peft_config", None)
    if configs is None:
        return True
    return all(
        getattr(getattr(c, "peft_type", None), "value", None) == "LORA"
        and not getattr(c, "is_prompt_learning", False)
        and not getattr(c, "alora_invocation_tokens", None)
        for c in configs.values()
    )


def quantised(base: CausalLM) -> bool:
    return bool(
        getattr(base, "hf_quantizer", None)
        or getattr(base, "is_quantized", False)
        or getattr(base, "is_loaded_in_4bit", False)
        or getattr(base, "is_loaded_in_8bit", False)
    )


def full_attention(cfg: PretrainedConfig) -> bool:
    """Every layer plain causal attention: no sliding window, no linear or recurrent layers."""
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    window = getattr(cfg, "sliding_window", None)
    return window is None or getattr(cfg, "use_sliding_window", True) is False


def settings_ok(model: CausalLM | PeftModel, config: GenerationConfig) -> bool:
    """The settings generate would use (ours over the model's generation_config over the defaults) differ from the
    defaults only where the loop does the same: plain sampling or greedy, the eos ids, pad, the length."""
    try:
        # its self is typed for the ty checker (transformers' GenerativePreTrainedModel), which mypy's view of a
        # transformers model does not meet
        merged = model._prepare_generation_config(config)[0]  # type: ignore[misc]
        changed = merged.to_diff_dict()
    except Exception:  # noqa: BLE001 - a transformers whose internals differ: generate knows its own
        return False
    if merged.do_sample != config.do_sample or merged.max_new_tokens != config.max_new_tokens:
        return False
    if merged.pad_token_id != config.pad_token_id or merged.eos_token_id != config.eos_token_id:
        return False
    if merged.do_sample and not (merged.temperature == config.temperature and (config.temperature or 0) > 0):
        return False
    allowed = {**NEUTRAL, **(WARPERS if merged.do_sample else dict.fromkeys(WARPERS, ANY))}  # greedy: no warpers
    return all(k in allowed and ((values := allowed[k]) is ANY or changed[k] in values) for k in changed)


def cache_keyword(base: CausalLM) -> str | None:
    """The forward's name for its key/value cache: `cache` in newer transformers, `past_key_values` before."""
    params = inspect.signature(base.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def cache_of(out):
    for key in ("cache", "past_key_values"):
        found = out.get(key) if hasattr(out, "get") else getattr(out, key, None)
        if found is not None:
            return found
    return None


def lean(
    model: CausalLM | PeftModel, ids: torch.Tensor, mask: torch.Tensor, config: GenerationConfig
) -> torch.Tensor | None:
    """The decode loop (under inference_mode: no autograd bookkeeping, the same kernels); None where the model's
    cache turns out not to be a plain DynamicCache (nothing drawn yet)."""
    base = base_of(model)
    keyword, device = cache_keyword(base), ids.device
    assert keyword is not None, "lean_ok checked that the forward takes a cache"
    pad = torch.tensor(config.pad_token_id, device=device)
    eos = torch.tensor(config.eos_token_id, device=device).view(-1)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    out = base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache = cache_of(out)
    if type(cache) is not DynamicCache:
        return None
    rows = ids.shape[0]
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    tokens: list[torch.Tensor] = []
    position = positions[:, -1:]
    for n in range(config.max_new_tokens):
        if n:
            position = position + 1
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
            step = dict(attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1)
            out = base(input_ids=tokens[-1][:, None], **step, **{keyword: cache})
        chosen = pick(out.logits[:, -1].to(dtype=torch.float32), config)
        del out
        chosen = chosen * unfinished + pad * (1 - unfinished)
        tokens.append(chosen)
        unfinished = unfinished & ~torch.isin(chosen, eos)
        if unfinished.max() == 0:
            break
    return torch.cat([ids, torch.stack(tokens, dim=1)], dim=1)


def pick(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Each row's next token: drawn at the temperature (generate's TemperatureLogitsWarper, then softmax and
    multinomial), or the most likely."""
    if not config.do_sample:
        return torch.argmax(logits, dim=-1)
    if config.temperature != 1.0:
        logits = logits / config.temperature
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1).squeeze(1)


@contextmanager
def lean_lora(model: torch.nn.Module) -> Iterator[None]:
    """Each plain LoRA linear layer (peft's lora.Linear over an nn.Linear, its adapters vanilla, not merged, not
    disabled) computes just what peft's forward computes for it, base(x) + B(A(x)) * scaling per active adapter,
    dropout off, without peft's per-call checks (a tenth of a small model's decode step); restored after."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # no peft: nothing to do
        yield
        return
    plain = [m for m in model.modules() if type(m) is LoraLinear and "forward" not in m.__dict__]
    swapped = [(m, f) for m in plain if (f := direct_forward(m)) is not None]
    for m, f in swapped:
        m.forward = f  # type: ignore[method-assign]  # the instance's own, over its class's: deleted after
    try:
        yield
    finally:
        for m, _ in swapped:
            del m.forward


def direct_forward(layer):
    """peft's lora.Linear.forward for this layer as it is now, in eval mode, as plain linear maps; None where the
    layer is anything but plain (a variant such as DoRA, dropout on, another dtype, merged, disabled)."""
    base = layer.base_layer
    if layer.training or layer.merged or layer.disable_adapters or type(base) is not nn.Linear:
        return None
    parts = []
    for name in [a for a in layer.active_adapters if a in layer.lora_A]:
        a, b, drop = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
        if (
            name in getattr(layer, "lora_variant", {name: "unknown"})
            or type(a) is not nn.Linear
            or type(b) is not nn.Linear
        ):
            return None
        if type(drop) not in (nn.Identity, nn.Dropout) or drop.training:
            return None
        if a.weight.dtype != base.weight.dtype or b.weight.dtype != base.weight.dtype:
            return None
        parts.append((a.weight, a.bias, b.weight, b.bias, layer.scaling[name]))
    original = layer.forward

    def forward(x, *args, **kwargs):
        if args or kwargs or x.dtype != base.weight.dtype:
            return original(x, *args, **kwargs)
        result = F.linear(x, base.weight, base.bias)
        for a_weight, a_bias, b_weight, b_bias, scaling in parts:
            result = result + F.linear(F.linear(x, a_weight, a_bias), b_weight, b_bias) * scaling
        return result

    return forward
