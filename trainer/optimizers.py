"""The optimizer a job chose, built over the adapter's parameters."""

from __future__ import annotations

import torch

from trainer.errors import JobError


def make_optimizer(params, t, device: str) -> torch.optim.Optimizer:
    """adamw and sgd from torch, adafactor from transformers, adamw_8bit from bitsandbytes (GPU only)."""
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=t.learning_rate, betas=tuple(t.adam_betas), eps=t.adam_eps,
                                 weight_decay=t.weight_decay)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay)
    if t.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=t.learning_rate, scale_parameter=False, relative_step=False, warmup_init=False,
                         weight_decay=t.weight_decay)
    if t.optimizer == "adamw_8bit":
        if device != "cuda":
            raise JobError("train.optimizer adamw_8bit runs on a GPU only, and this job runs on a CPU; submit it with "
                           "accelerator 'gpu', or choose adamw")
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise JobError("train.optimizer adamw_8bit needs bitsandbytes on the node: pip install 'jetlora[qlora]' "
                           "there, or choose adamw") from None
        return bnb.optim.AdamW8bit(params, lr=t.learning_rate, betas=tuple(t.adam_betas), eps=t.adam_eps,
                                   weight_decay=t.weight_decay)
    raise JobError(f"train.optimizer {t.optimizer!r} is not one this trainer knows; choose adamw, adamw_8bit, "
                   "adafactor or sgd")
