"""The base a group's process holds: loaded with the first job that joins, and the only content a later one joins
(by its digest, schemas/weights_digest.py), in the same precision, quantisation and device kind."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from schemas.events import TrainerSpec
from schemas.weights_digest import FileDigests
from trainer import model as base_model
from trainer.errors import JobError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OtherWeights(JobError):
    """A joiner whose base is not the group's content."""


class HeldBase:
    def __init__(self) -> None:
        self.key: tuple | None = None  # what every job of the group shares: content digest, precision, quant, device
        self.base_dir = ""  # where the base was loaded from
        self.device = "cpu"
        self.dtype = torch.float32
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.model: Any = None
        self.digests = FileDigests()  # a joiner's base hashed here only when the agent sent no digest

    def admit(self, spec: TrainerSpec) -> bool:
        """Let the job in: True when it loaded the base (the first); OtherWeights or JobError when it may not join."""
        r = spec.request
        if r.devices > 1:
            raise JobError(f"devices {r.devices}: a job on several devices trains alone, not in a co-training group")
        digest = spec.base_digest or self._digest(r.base_dir)
        key = (digest, r.train.precision, r.quantization, spec.device)
        if self.key is None:
            self.device = spec.device if spec.device == "cpu" or torch.cuda.is_available() else "cpu"
            self.dtype = base_model.pick_dtype(r.train.precision, self.device)
            self.tokenizer, self.model = base_model.load(r.base_dir, self.device, self.dtype, r.quantization)
            self.key, self.base_dir = key, r.base_dir
            return True
        if key[0] != self.key[0]:
            raise OtherWeights(
                f"its base_dir {r.base_dir} ({digest}) is not the content of the co-training group's base "
                f"{self.base_dir} ({self.key[0]}): it was not let in, and is handed back to train alone"
            )
        if key != self.key:
            raise JobError(
                f"job {spec.job} (precision, quantization, device = {key[1:]}) cannot join a group training "
                f"{self.key[1:]}; submit it with co_train: false to train alone"
            )
        return False

    def _digest(self, base_dir: str) -> str:
        try:
            return self.digests.directory(base_dir)
        except ValueError as e:
            raise JobError(f"base_dir {base_dir}: {e}") from None
