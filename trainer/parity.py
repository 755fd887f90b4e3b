"""The probe set's per-token log-probabilities (schemas/parity.py), teacher-forced: with the trained adapter, and
with it off (the base model alone), as engines that serve the adapter are later asked for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from schemas.parity import PARITY_TEXTS, ParityText

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer.model import AdaptedLM


def parity_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[str, list[int], bool]:
    """(the prompt an engine is sent as text, its tokens, whether they start with BOS): tokenized as a completions API
    does (special tokens added); where the tokenizer adds no BOS and the model has one, it is written out in front,
    so an engine that echoes log-probabilities (llama-cpp-python: it scores a prompt right only after a BOS) lines
    up with the trainer's tokens."""
    ids = tokenizer(text)["input_ids"]
    bos, bos_text = tokenizer.bos_token_id, tokenizer.bos_token
    if bos is None or not bos_text:
        return text, ids, False
    if ids and ids[0] == bos:
        return text, ids, True
    return bos_text + text, [bos, *ids], True


@torch.no_grad()
def token_logprobs(model: AdaptedLM, ids: list[int], device: str) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from the model's logits in float64 (the forward in its own dtype)."""
    inputs = torch.tensor([ids], device=device)
    logits = model(input_ids=inputs, attention_mask=torch.ones_like(inputs)).logits[0, :-1].to("cpu", torch.float64)
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def parity_set(
    model: AdaptedLM, tokenizer: PreTrainedTokenizerBase, device: str, base: bool = True
) -> list[ParityText]:
    """Each probe-set text scored with the adapter and, unless `base` is False (the trainer changed the base weights:
    pissa, loftq), with the adapter off."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for text in PARITY_TEXTS:
            prompt, ids, starts = parity_ids(tokenizer, text)
            scored = ParityText(prompt=prompt, ids=ids, bos=starts, adapter=token_logprobs(model, ids, device))
            if base:
                with model.disable_adapter():
                    scored.base = token_logprobs(model, ids, device)
            out.append(scored)
    finally:
        if was_training:
            model.train()
    return out
