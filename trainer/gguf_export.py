"""A PEFT LoRA adapter as a GGUF LoRA adapter for llama.cpp, written with the `gguf` package.

What llama.cpp's convert_lora_to_gguf.py does, for the architectures gguf's tensor map knows:
each `<module>.lora_A/B.weight` becomes `<gguf tensor name>.lora_a/.lora_b`, kept in PEFT's
orientation (lora_a is [r, in], lora_b is [out, r]; llama-adapter.cpp checks exactly that),
with Llama's rotary permutation applied to the q and k projections' lora_b, as the base
model's conversion applied it to the q and k weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from trainer.errors import JobError

# Hugging Face model_type values that llama.cpp converts as another architecture
ALIASES = {"mistral": "llama"}
# llama.cpp's base-model conversion (convert_hf_to_gguf and its conversion/ package, as vendored by
# llama-cpp-python 0.3.36) permutes the q/k rows of these architectures, directly or by inheriting
# LlamaModel's modify_tensors: an adapter's q/k lora_b must be permuted the same way.
PERMUTED_ARCHS = {
    "llama",
    "olmo",
    "granite",
    "granitemoe",
    "granite_swa",
    "granite_switch",
    "minicpm",
    "internlm2",
    "arctic",
    "chameleon",
    "deepseek",
    "deci",
    "llada",
    "apertus",
    "arcee",
    "smollm3",
    "nanbeige",
    "llama4",
    "cogvlm",
    "llama-embed",
    "mistral3",
}
# Architectures whose exported adapter was compared with peft inside llama.cpp (logits within f32 tolerance).
# Any other is refused before training: an adapter llama.cpp loads without error but computes wrongly is worse
# than none.
# tests/test_gguf_llamacpp.py, llama-cpp-python 0.3.36: max |logit difference| from peft 3e-7 to 4.4e-6.
VERIFIED_ARCHS = {"llama", "qwen2", "olmo", "granite"}
GGUF_TYPES = {
    "f32": (np.float32, None),
    "f16": (np.float16, None),
    "bf16": (None, gguf.GGMLQuantizationType.BF16),
    "q8_0": (None, gguf.GGMLQuantizationType.Q8_0),
}


def architecture(config: dict) -> gguf.MODEL_ARCH:
    model_type = config.get("model_type", "")
    name = ALIASES.get(model_type, model_type)
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if name not in by_name:
        raise JobError(
            f"architecture {model_type!r} ({config.get('architectures')}) is not known to the gguf package's "
            "tensor map, so no GGUF adapter can be written; serve this model with vllm (served_by=vllm)"
        )
    return by_name[name]


def check_exportable(base_dir: str | Path) -> None:
    """Before training: refuse a base whose GGUF adapter export has not been verified against llama.cpp."""
    config = json.loads((Path(base_dir) / "config.json").read_text())
    name = gguf.MODEL_ARCH_NAMES[architecture(config)]
    if name not in VERIFIED_ARCHS:
        raise JobError(
            f"a GGUF adapter for architecture {config.get('model_type')!r} ({name}) has not been verified "
            f"against llama.cpp (verified: {', '.join(sorted(VERIFIED_ARCHS))}, and mistral as llama); "
            "serve this model with vllm (served_by=vllm), which loads the PEFT adapter"
        )


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k rows (LlamaModel.permute in convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def lora_pairs(adapter_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """{'model.layers.0.self_attn.q_proj': {'A': [r, in], 'B': [out, r]}} from adapter_model.safetensors."""
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if key.endswith(suffix):
                module = key[: -len(suffix)].removeprefix("base_model.model.")
                pairs.setdefault(module, {})[part] = value.astype(np.float32)
                break
        else:
            raise JobError(f"adapter tensor {key} is not a LoRA A/B matrix; only plain LoRA adapters convert to GGUF")
    return pairs


def export_adapter(
    adapter_dir: str | Path,
    base_dir: str | Path,
    out_path: str | Path,
    out_type: str = "f16",
    name: str = "",
    base_model: str = "",
) -> Path:
    """Write the adapter as GGUF; `name` and `base_model` become general.name and general.base_model.0.name,
    as llama.cpp's own converter records them."""
    adapter_dir, out_path = Path(adapter_dir), Path(out_path)
    config = json.loads((Path(base_dir) / "config.json").read_text())
    peft_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    arch = architecture(config)
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    n_blocks = config.get("num_hidden_layers") or config.get("n_layer")
    tmap = gguf.get_tensor_name_map(arch, n_blocks)
    n_head = config.get("num_attention_heads")
    n_kv = config.get("num_key_value_heads") or n_head

    r, alpha = peft_config["r"], float(peft_config["lora_alpha"])
    if peft_config.get("use_rslora"):
        alpha = alpha * math.sqrt(r)  # llama.cpp scales by alpha / r; rsLoRA means alpha / sqrt(r)

    writer = gguf.GGUFWriter(str(out_path), arch_name)
    writer.add_string(gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_name(name or adapter_dir.name)
    if base_model:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, base_model)
    for module, ab in sorted(lora_pairs(adapter_dir).items()):
        if set(ab) != {"A", "B"}:
            raise JobError(f"adapter module {module} lacks its lora_{'A' if 'A' not in ab else 'B'} matrix")
        tensor_name = tmap.get_name(module + ".weight", try_suffixes=(".weight",))
        if tensor_name is None:
            raise JobError(
                f"tensor {module}.weight has no GGUF name in gguf's map for architecture {arch_name}; "
                "leave that module out of lora.target_modules or serve with vllm"
            )
        a, b = ab["A"], ab["B"]
        if arch_name in PERMUTED_ARCHS and module.endswith("q_proj"):
            b = permute(b, n_head)
        elif arch_name in PERMUTED_ARCHS and module.endswith("k_proj"):
            b = permute(b, n_kv)
        for suffix, tensor in ((".lora_a", a), (".lora_b", b)):
            _add(writer, tensor_name + suffix, tensor, out_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add(writer: gguf.GGUFWriter, name: str, tensor: np.ndarray, out_type: str) -> None:
    np_type, qtype = GGUF_TYPES[out_type]
    if qtype is None:  # a plain float type
        writer.add_tensor(name, np.ascontiguousarray(tensor.astype(np_type)))
        return
    try:
        data = gguf.quants.quantize(np.ascontiguousarray(tensor), qtype)
    except gguf.quants.QuantError:  # rows not a multiple of the block size (e.g. lora_b's r columns): keep f16
        writer.add_tensor(name, np.ascontiguousarray(tensor.astype(np.float16)))
        return
    writer.add_tensor(name, data, raw_dtype=qtype)
