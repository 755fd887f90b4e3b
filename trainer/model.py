"""Load a base model and its tokenizer from a local directory of safetensors: no hub, no pickles, no remote code."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.errors import JobError


def check_model_dir(base_dir: str) -> Path:
    path = Path(base_dir)
    if not path.is_dir():
        raise JobError(f"base_dir {base_dir} is not a directory on this node; copy the model there or fix base_dir")
    if not (path / "config.json").is_file():
        raise JobError(f"base_dir {base_dir} has no config.json; point base_dir at a Hugging Face model directory")
    if not list(path.glob("*.safetensors")):
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (
            f" (it has {', '.join(pickles[:3])}: pickled weights are never loaded; convert them to safetensors)"
            if pickles
            else ""
        )
        raise JobError(f"base_dir {base_dir} has no .safetensors weights{hint}")
    config = json.loads((path / "config.json").read_text())
    if config.get("auto_map"):
        raise JobError(
            f"the model in {base_dir} needs its own code (auto_map in config.json); jetlora never runs "
            "remote code: use an architecture transformers ships"
        )
    return path


def attention_for(device: str, dtype: torch.dtype) -> str:
    """flash-attention 2 where the node has it (a CUDA device, half precision, the flash-attn package): its varlen
    kernel takes a packed row's examples apart by their position ids, with no mask; elsewhere PyTorch's own SDPA
    (a packed row's block-diagonal mask on CPU)."""
    half = dtype in (torch.bfloat16, torch.float16)
    if device == "cuda" and half and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def pick_dtype(precision: str, device: str) -> torch.dtype:
    if precision == "fp32" or (precision == "auto" and device == "cpu"):
        return torch.float32
    if precision == "bf16" or (precision == "auto" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return torch.float16


def load(base_dir: str, device: str, dtype: torch.dtype, quantization: str = "none"):
    path = check_model_dir(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if quantization == "nf4":
        return tokenizer, load_nf4(path, device, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        local_files_only=True,
        trust_remote_code=False,
        use_safetensors=True,
        dtype=dtype,
        attn_implementation=attention_for(device, dtype),
    )
    return tokenizer, model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides self


def pad_id(tokenizer) -> int:
    """The id a batch is padded with: the tokenizer's pad token, else its eos (id 0 is a real id, not a missing one)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def load_nf4(path: Path, device: str, dtype: torch.dtype):
    """QLoRA's base: 4-bit NormalFloat weights with double quantization, computing in `dtype`; the LoRA weights
    stay in full precision."""
    if device != "cuda":
        raise JobError(
            "quantization nf4 needs a CUDA GPU (bitsandbytes); this job was given a CPU: resubmit with "
            "accelerator 'gpu', or quantization 'none'"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise JobError(
            "quantization nf4 needs the bitsandbytes package on this node: pip install -e '.[qlora]' "
            "in the trainer's environment"
        ) from None
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype if dtype != torch.float32 else torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path,
        local_files_only=True,
        trust_remote_code=False,
        use_safetensors=True,
        dtype=quant.bnb_4bit_compute_dtype,
        quantization_config=quant,
        device_map={"": torch.cuda.current_device()},
        attn_implementation=attention_for(device, quant.bnb_4bit_compute_dtype),
    )
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
