"""The GGUF adapter inside llama.cpp itself: for each architecture jetlora exports, llama.cpp's logits with the
adapter must equal peft's. Needs llama-cpp-python (`pip install -e .[llamacpp]`, a build of about 7 minutes) and a
llama.cpp checkout for its base-model converter (LLAMA_CPP_DIR; llama-cpp-python's sdist vendors one)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from schemas.jobs import ATTENTION_AND_MLP
from tests.conftest import ROOT, tinymodel
from tests.qa import QA_PAIRS
from trainer.gguf_export import ALIASES, VERIFIED_ARCHS, export_adapter

LLAMA_CPP_DIR = os.environ.get("LLAMA_CPP_DIR", "")
MISSING = [
    why
    for missing, why in (
        (
            importlib.util.find_spec("llama_cpp") is None,
            "llama-cpp-python is not installed (pip install -e .[llamacpp])",
        ),
        (
            not (Path(LLAMA_CPP_DIR) / "convert_hf_to_gguf.py").is_file(),
            "LLAMA_CPP_DIR does not name a llama.cpp checkout with convert_hf_to_gguf.py",
        ),
    )
    if missing
]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
ARCHS = {  # model_type -> transformers config class and its extra settings
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "olmo": ("OlmoConfig", {"clip_qkv": None}),
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0078,
            "logits_scaling": 8.0,
        },
    ),
}
TOKENS = [1, 17, 42, 99, 7, 230, 5, 64, 12, 88, 150, 3]


def build_base(model_type: str, out: Path) -> Path:
    import transformers

    tok = tinymodel().build_tokenizer([f"{q} {a}" for q, a in QA_PAIRS], 300)
    config_class, extra = ARCHS[model_type]
    config = getattr(transformers, config_class)(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SHAPE, **extra
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def peft_adapter(base: Path, out: Path, rslora: bool):
    """A LoRA whose A and B are both random (peft's init_lora_weights=False), so it moves every target."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(1)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=8, lora_alpha=128, target_modules=ATTENTION_AND_MLP, init_lora_weights=False, use_rslora=rslora),
    )
    peft_model.save_pretrained(out)
    return peft_model


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float().numpy()


def llama_cpp_logits(base_gguf: Path, adapter_gguf: Path | None) -> np.ndarray:
    from llama_cpp import Llama

    f32 = 0  # GGML_TYPE_F32: an f16 KV cache alone would differ by ~1e-2
    llm = Llama(
        model_path=str(base_gguf),
        lora_path=str(adapter_gguf) if adapter_gguf else None,
        logits_all=True,
        n_ctx=64,
        n_threads=2,
        verbose=False,
        type_k=f32,
        type_v=f32,
    )
    llm.eval(TOKENS)
    return np.array(llm.scores[: len(TOKENS)], dtype=np.float32)


@pytest.mark.parametrize("model_type, rslora", [(t, False) for t in ARCHS] + [("llama", True)])
def test_llama_cpp_computes_what_peft_computes_with_the_exported_adapter(model_type, rslora, tmp_path):
    base = build_base(model_type, tmp_path / "base")
    base_gguf = tmp_path / "base.gguf"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "programs" / "convert_base.py"),
            LLAMA_CPP_DIR,
            str(base),
            str(base_gguf),
        ],
        check=True,
        capture_output=True,
    )
    peft_model = peft_adapter(base, tmp_path / "adapter", rslora)
    adapter_gguf = export_adapter(tmp_path / "adapter", base, tmp_path / "adapter.gguf", "f32")

    with peft_model.disable_adapter():
        plain = hf_logits(peft_model)
    tuned = hf_logits(peft_model)
    base_diff = np.abs(llama_cpp_logits(base_gguf, None) - plain).max()
    adapter_diff = np.abs(llama_cpp_logits(base_gguf, adapter_gguf) - tuned).max()
    effect = np.abs(tuned - plain).max()
    print(
        f"{model_type}{' rslora' if rslora else ''}: base max|diff| {base_diff:.1e}, with the adapter {adapter_diff:.1e} "
        f"(the adapter moves logits by up to {effect:.2f})"
    )
    assert effect > 0.05, "the adapter barely changes the logits: the comparison would prove nothing"
    assert base_diff < 1e-4, "the harness itself disagrees: the base model differs before any adapter"
    assert adapter_diff < 1e-4, f"llama.cpp computes another function with the {model_type} adapter"
    assert ALIASES.get(model_type, model_type) in VERIFIED_ARCHS  # what is checked here is what jobs may export
