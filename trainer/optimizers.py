"""The optimizer a job chose, built over the adapter's parameters."""

from __future__ import annotations

import torch

from trainer.errors import JobError, bitsandbytes_on_gpu


def make_optimizer(params, t, device: str) -> torch.optim.Optimizer:
    """adamw and sgd from torch, adafactor from transformers, adamw_8bit from bitsandbytes (GPU only)."""
    if t.optimizer == "adamw":
        return torch.optim.AdamW(
            params, lr=t.learning_rate, betas=tuple(t.adam_betas), eps=t.adam_eps, weight_decay=t.weight_decay
        )
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay)
    if t.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(
            params,
            lr=t.learning_rate,
            scale_parameter=False,
            relative_step=False,
            warmup_init=False,
            weight_decay=t.weight_decay,
        )
    if t.optimizer == "adamw_8bit":
        bnb = bitsandbytes_on_gpu("train.optimizer adamw_8bit", device, "adamw")
        return bnb.optim.AdamW8bit(
            params, lr=t.learning_rate, betas=tuple(t.adam_betas), eps=t.adam_eps, weight_decay=t.weight_decay
        )
    raise JobError(
        f"train.optimizer {t.optimizer!r} is not one this trainer knows; choose adamw, adamw_8bit, adafactor or sgd"
    )
