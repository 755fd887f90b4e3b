"""How much device memory a job's training takes at its peak, from the base model's config and the job's settings,
before anything is loaded: the scheduler places `gpu_mib: 0` jobs by it and refuses those no device can hold.

Pure Python (no torch): the scheduler and the CLI use it. The terms are what the trainer keeps at its peak step:
the frozen weights, the LoRA weights with their gradients and AdamW moments, what autograd saves per token per layer
(all layers, or only each layer's input with gradient checkpointing), and the loss's logits. The per-token
coefficients are counted from a Llama decoder layer (bench/memory_estimate.py measures them against real peaks).
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

MIB = 2**20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
NF4_BYTES = 0.5 + 4 / 64 + 1 / 256  # 4-bit weights, an fp32 scale per 64 (double-quantized: ~1 byte per 256)
CUDA_CONTEXT_MIB = 600  # the CUDA context and cuBLAS workspaces: outside max_memory_allocated, inside the card
ALLOCATOR_MARGIN = 1.10  # the caching allocator's fragmentation
LORA_BYTES = 4 + 4  # a LoRA weight in fp32 and its gradient; the optimizer's state per weight is on top:
OPTIMIZER_BYTES = {"adamw": 8, "adamw_8bit": 2, "sgd": 4, "adafactor": 0}  # two fp32 moments; two 8-bit; momentum
INIT_COPIES = {"pissa": 3, "loftq": 5}  # fp32 copies of the largest target matrix its start holds at once (SVD)
MLP = ("gate_proj", "up_proj", "down_proj")


class ModelShape(Struct, kw_only=True, omit_defaults=True):
    """What the estimate needs of a base model: read from its config.json (and safetensors headers) by the agent
    that has it, and sent in heartbeats."""

    dir: str  # the model directory on the node: a job's base_dir
    params: Annotated[int, Meta(ge=0)]
    layers: Annotated[int, Meta(ge=1)]
    hidden: Annotated[int, Meta(ge=1)]
    intermediate: Annotated[int, Meta(ge=1)]
    heads: Annotated[int, Meta(ge=1)]
    kv_heads: Annotated[int, Meta(ge=1)]
    head_dim: Annotated[int, Meta(ge=1)]
    vocab: Annotated[int, Meta(ge=1)]
    experts: int = 1  # mixture-of-experts: MLPs per layer
    dtype: str = "bfloat16"
    digest: str = ""  # the content's identity (schemas/weights_digest.py): jobs co-train only on equal ones; "" until
    # the agent has hashed the base (a heartbeat may come first: then the scheduler groups by directory)

    @classmethod
    def from_config(cls, directory: str, config: dict, params: int | None = None) -> "ModelShape":
        """From a transformers config.json; params from the weights' headers when known, else counted here."""
        text = config.get("text_config") or config  # multimodal configs nest the language model's
        hidden = int(text["hidden_size"])
        heads = int(text.get("num_attention_heads", max(1, hidden // 128)))
        shape = cls(
            dir=directory,
            params=0,
            layers=int(text["num_hidden_layers"]),
            hidden=hidden,
            intermediate=int(text.get("intermediate_size") or 4 * hidden),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab=int(text["vocab_size"]),
            experts=int(text.get("num_local_experts") or text.get("num_experts") or 1),
            dtype=str(text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16"),
        )
        shape.params = params or shape.counted_params(
            bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings")))
        )
        return shape

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of a decoder layer, by module name."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear layers (each expert's MLP counted): what nf4 quantizes."""
        per_layer = sum(a * b * (self.experts if name in MLP else 1) for name, (a, b) in self.linear_dims().items())
        return self.layers * per_layer

    def counted_params(self, tied: bool) -> int:
        norms = self.layers * 2 * self.hidden + self.hidden
        return self.linear_params() + norms + self.vocab * self.hidden * (1 if tied else 2)


class Estimate(Struct, kw_only=True):
    """A job's predicted peak, in MiB, and its parts."""

    mib: int
    weights_mib: int
    lora_mib: int
    activations_mib: int
    logits_mib: int
    overhead_mib: int
    tokens: int  # per micro-batch

    def why(self) -> str:
        return (
            f"weights {self.weights_mib:,} + LoRA and optimizer {self.lora_mib:,} + activations of "
            f"{self.tokens:,} tokens {self.activations_mib:,} + logits {self.logits_mib:,} + CUDA "
            f"{self.overhead_mib:,} MiB"
        )


def optimizer_state(t, r: int, targets: list[tuple[int, int]], layers: int, lora_params: int) -> int:
    """Bytes of optimizer state for the LoRA weights: per weight for AdamW and SGD with momentum; Adafactor keeps
    a row and a column factor per matrix (A is r x in, B out x r)."""
    if t.optimizer == "adafactor":
        return layers * sum((r + a) + (b + r) for a, b in targets) * 4
    if t.optimizer == "sgd" and not t.momentum:
        return 0
    return lora_params * OPTIMIZER_BYTES[t.optimizer]


def estimate(shape: ModelShape, request, device: str = "cuda") -> Estimate:
    """The peak MiB of training `request` (a JobRequest) on one device of `device` kind ("cuda" or "cpu")."""
    t, lora = request.train, request.lora
    act = 4 if device == "cpu" or t.precision == "fp32" else 2  # bytes per activation value
    weight_bytes = 4 if device == "cpu" or t.precision == "fp32" else DTYPE_BYTES.get(shape.dtype, 2)
    dims = shape.linear_dims()
    if request.quantization == "nf4":  # the embeddings, output projection and norms stay in bf16
        linear = shape.linear_params()
        weights = linear * NF4_BYTES + max(shape.params - linear, 0) * 2
    else:
        weights = shape.params * weight_bytes

    targets = [dims.get(name, (shape.hidden, shape.hidden)) for name in lora.target_modules]
    lora_params = shape.layers * sum(lora.r * (a + b) for a, b in targets)
    lora_bytes = lora_params * LORA_BYTES + optimizer_state(t, lora.r, targets, shape.layers, lora_params)
    tokens = t.batch_size * t.max_seq_length

    # What autograd keeps per token of a decoder layer, each tensor once however many ops save it: the two RMSNorms'
    # fp32 inputs; attention's q, k, v and output; the MLP's gate, its activation and up; and the inputs of
    # LoRA-targeted layers that nothing else keeps (the normed input of q/k/v, of gate/up, and down's input).
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    names = set(lora.target_modules)
    per_layer = 2 * h * 4 + (2 * q + 2 * kv) * act + 3 * i * act
    per_layer += act * (
        h * bool(names & {"q_proj", "k_proj", "v_proj"})
        + h * bool(names & {"gate_proj", "up_proj"})
        + i * ("down_proj" in names)
    )
    if lora.dropout:  # each target's dropped-out input and its mask
        per_layer += sum(a for a, _ in targets) * (act + 1)
    # The backward of a layer holds gradients as big as what the layer saved: one layer's worth on top.
    if t.gradient_checkpointing:  # each layer's input, and one layer's full set while it is recomputed
        saved = tokens * (shape.layers * h * act + 2 * per_layer + h * 4)
    else:
        saved = tokens * ((shape.layers + 1) * per_layer + h * act)

    # The loss: logits (and their fp32 copy when training in bf16), the fp32 log-softmax and its gradient, for a
    # chunk of tokens or all of them at once.
    chunk = min(t.loss_chunk_tokens or tokens, tokens)
    logits = chunk * shape.vocab * (12 if act == 4 else 14) + tokens * h * 4

    overhead = CUDA_CONTEXT_MIB * MIB if device == "cuda" else 0
    start = INIT_COPIES.get(lora.init, 0) * max((a * b for a, b in targets), default=0) * 4  # before any step
    total = (weights + lora_bytes + max(saved + logits, start)) * ALLOCATOR_MARGIN + overhead
    mib = lambda b: int(math.ceil(b / MIB))  # noqa: E731
    return Estimate(
        mib=mib(total),
        weights_mib=mib(weights),
        lora_mib=mib(lora_bytes),
        activations_mib=mib(saved),
        logits_mib=mib(logits),
        overhead_mib=mib(overhead),
        tokens=tokens,
    )


def what_would_fit(shape: ModelShape, request, free_mib: int) -> list[str]:
    """Changes to the request that bring its estimate under free_mib, each with its new estimate, most useful
    first; the scheduler's refusal names them."""
    t, options = request.train, []

    def train(**changes):
        return msgspec.structs.replace(request, train=msgspec.structs.replace(t, **changes))

    if not t.gradient_checkpointing:
        options.append(("set train.gradient_checkpointing", train(gradient_checkpointing=True)))
    if t.batch_size > 1:
        options.append(
            (
                f"lower train.batch_size to 1 (raise grad_accum to {t.grad_accum * t.batch_size} to keep "
                "the step's examples)",
                train(batch_size=1, grad_accum=t.grad_accum * t.batch_size),
            )
        )
    if not t.gradient_checkpointing and t.batch_size > 1:
        options.append(
            ("both", train(gradient_checkpointing=True, batch_size=1, grad_accum=t.grad_accum * t.batch_size))
        )
    if request.quantization == "none":
        options.append(("set quantization to nf4", msgspec.structs.replace(request, quantization="nf4")))
    out = []
    for what, changed in options:
        need = estimate(shape, changed).mib
        out.append(f"{what}: ~{need:,} MiB" + ("" if need <= free_mib else " (still too much)"))
    return out
