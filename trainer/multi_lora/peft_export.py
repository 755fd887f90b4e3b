"""A co-trained job's adapter saved as peft saves a job's own: adapter_config.json (peft's LoraConfig for the
job's `lora`) and adapter_model.safetensors with peft's key names for a causal LM, so that
PeftModel.from_pretrained, vLLM and llama.cpp's converter take it like any other."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.adapter_init import lora_config
from trainer.multi_lora.layer import LoraWeights

PREFIX = "base_model.model."  # what peft's PeftModelForCausalLM puts before the base model's module names


def peft_state_dict(weights: dict[str, LoraWeights]) -> dict[str, torch.Tensor]:
    """The LoRA weights under the names peft saves them by."""
    out = {}
    for module, w in weights.items():
        out[f"{PREFIX}{module}.lora_A.weight"] = w.A.detach().to("cpu").contiguous()
        out[f"{PREFIX}{module}.lora_B.weight"] = w.B.detach().to("cpu").contiguous()
    return out


def save_peft_adapter(weights: dict[str, LoraWeights], lora, base_dir: str, out: Path) -> Path:
    """Write the adapter to `out` (a directory) in peft's layout; `lora` is the job's schemas LoraConfig."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = lora_config(lora, "cpu")
    config.base_model_name_or_path = base_dir
    config.inference_mode = True
    config.save_pretrained(str(out))
    save_file(peft_state_dict(weights), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
