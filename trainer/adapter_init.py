"""How the adapter starts (peft's initialisers), and how one whose start changed the base's weights is saved as
a plain LoRA of the original base, so that llama.cpp and vLLM serve it like any other."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from peft import LoftQConfig, LoraConfig, PeftModel, get_peft_model_state_dict

from schemas.training import MUTATING_INITS
from trainer.job.checkpoints import save_adapter
from trainer.errors import bitsandbytes_on_gpu

if TYPE_CHECKING:
    from schemas.training import LoraConfig as LoraSettings
    from trainer.model import TrainedAdapter

PEFT_INIT: dict[str, bool | Literal["gaussian", "pissa", "loftq"]] = {
    "default": True,
    "gaussian": "gaussian",
    "pissa": "pissa",
    "loftq": "loftq",
}


def lora_config(lo: LoraSettings, device: str) -> LoraConfig:
    """peft's LoraConfig for the job's `lora`."""
    loftq: LoftQConfig | dict = {}  # peft's default: none
    if lo.init == "loftq":
        bitsandbytes_on_gpu("lora.init loftq", device, "pissa or default")  # it quantises the base's weights
        loftq = LoftQConfig(loftq_bits=lo.loftq.bits, loftq_iter=lo.loftq.iterations)
    return LoraConfig(
        r=lo.r,
        lora_alpha=lo.alpha,  # type: ignore[arg-type]  # peft annotates an int; it divides by r: a float scales as asked
        lora_dropout=lo.dropout,
        target_modules=list(lo.target_modules),
        use_rslora=lo.rslora,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=PEFT_INIT[lo.init],
        loftq_config=loftq,
    )


def initial_weights(model: PeftModel, lo: LoraSettings) -> dict[str, torch.Tensor] | None:
    """The adapter as it starts, for an initialiser that moved part of the base into it (None for the others)."""
    if lo.init not in MUTATING_INITS:
        return None
    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


def save_plain_lora(
    model: TrainedAdapter, out: Path, initial: dict[str, torch.Tensor] | None, lo: LoraSettings
) -> Path:
    """Save the adapter; one started by pissa or loftq is rewritten as the change from the original base W.
    PiSSA trains s*B*A on W - s*B0*A0, which is W + s*(B*A - B0*A0); LoftQ trains it on its quantised Q, about
    W - B0*A0 (peft does not scale its start), which is W + s*(B*A - B0*A0/s). Either is a LoRA of rank 2r,
    A' = [A; A0] and B' = [B, -B0 * k], with alpha chosen so that the scale s stays the same."""
    from safetensors.torch import load_file, save_file

    save_adapter(model, out)
    if initial is None:
        return out
    weights_file, config_file = out / "adapter_model.safetensors", out / "adapter_config.json"
    trained = load_file(str(weights_file))
    scale = lo.alpha / (math.sqrt(lo.r) if lo.rslora else lo.r)
    k = 1.0 if lo.init == "pissa" else 1.0 / scale
    plain = {}
    for key, value in trained.items():
        start = initial[key].to(value.dtype) * (k if ".lora_B." in key else 1.0)
        if ".lora_A." in key:
            plain[key] = torch.cat([value, start], dim=0).contiguous()
        elif ".lora_B." in key:
            plain[key] = torch.cat([value, -start], dim=1).contiguous()
        else:
            plain[key] = value
    save_file(plain, str(weights_file), metadata={"format": "pt"})
    config = json.loads(config_file.read_text())
    config.update(
        r=2 * lo.r, lora_alpha=lo.alpha * (math.sqrt(2) if lo.rslora else 2), init_lora_weights=True, loftq_config={}
    )
    config_file.write_text(json.dumps(config, indent=2))
    return out
