"""Load a base model and its tokenizer from a local directory of safetensors: no hub, no pickles, no remote code."""

from __future__ import annotations

import importlib.util
import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.errors import JobError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What AutoModelForCausalLM loads: a transformers model that generates (each architecture's own class,
        e.g. LlamaForCausalLM, is both; transformers has no one class for them)."""


class AdaptedLM(Protocol):
    """A causal LM with the adapter being trained, as the trainer's shared pieces (losses, evaluation, parity) take
    it: a peft model, or a co-training job's view of the shared base (co_train/shared_base.JobView)."""

    @property
    def training(self) -> bool: ...

    @property
    def base_model(self) -> Any: ...  # peft's tuner (a JobView: itself), where adapter layers are switched off

    def train(self) -> object: ...

    def eval(self) -> object: ...

    def get_base_model(self) -> torch.nn.Module: ...

    def disable_adapter(self) -> AbstractContextManager[object]: ...

    def __call__(self, **inputs: Any) -> Any: ...


class GeneratingLM(AdaptedLM, Protocol):
    """An AdaptedLM that also generates (samples, the probe): a peft model, or a co-training member's JobModel."""

    def generate(self, **inputs: Any) -> Any: ...

    def parameters(self) -> Iterator[torch.Tensor]: ...


class TrainedAdapter(Protocol):
    """The adapter's weights as keep-best, checkpoints and a run's end read and save them (peft's names and
    layout): a peft model, or a co-training member's JobModel."""

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def save_pretrained(
        self, save_directory: str, /, *, safe_serialization: bool, selected_adapters: list[str]
    ) -> object: ...


def base_of(model: object) -> CausalLM:
    """The transformers model itself: under a peft model's adapter (or a co-training job's view), else the model as
    it is. peft types get_base_model() as an nn.Module; under a causal LM's adapter it is the PreTrainedModel."""
    get_base = getattr(model, "get_base_model", None)
    return cast("CausalLM", get_base() if get_base is not None else model)


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


def load(
    base_dir: str, device: str, dtype: torch.dtype, quantization: str = "none"
) -> tuple[PreTrainedTokenizerBase, CausalLM]:
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


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id a batch is padded with: the tokenizer's pad token, else its eos (id 0 is a real id, not a missing one)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is None:
        raise JobError("the tokenizer has neither a pad token nor an eos token; add eos_token to tokenizer_config.json")
    return tokenizer.eos_token_id


def decoded(tokenizer: PreTrainedTokenizerBase, ids: list[int] | torch.Tensor) -> str:
    """One sequence's text, special tokens skipped (transformers types decode's result as a batch's texts too)."""
    return cast(str, tokenizer.decode(ids, skip_special_tokens=True))


def load_nf4(path: Path, device: str, dtype: torch.dtype) -> CausalLM:
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
