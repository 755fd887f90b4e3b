"""One session of a session group (trainer/session/group.py): its own LoRA on the group's shared base (trainer/
co_train/shared_base.py, started as peft starts one from the session's seed), its own optimizer, step, saves and
sampler weights (SessionCalls: the calls a session alone takes, the same code), and its own random state: a
sample without a seed draws from the member's generator, never from its neighbours'. Its events and answers go out
tagged with its job and attempt. A base model's sampler is a member whose calls all sample with its adapter off."""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

import torch

from schemas.events import GroupEvent, TrainerSpec
from schemas.training import LoraConfig
from trainer.multi_lora.layer import LoraWeights, Routing
from trainer.multi_lora.peft_export import PREFIX, peft_state_dict, save_peft_adapter
from trainer.multi_lora.shared_base import JobView, SharedBase
from trainer.errors import JobError
from trainer.events import emit
from trainer.session.calls import SessionCalls, Weights


class MemberModel(JobView):
    """The member's adapter on the shared base, as a session's calls take a peft model of its own: called, it runs
    the base with this member's LoRA on every row (none inside disable_adapter); generate likewise; saved in peft's
    layout; its parameters named as peft names them."""

    def __init__(self, base: SharedBase, job: str, weights: dict[str, LoraWeights], lora: LoraConfig, base_dir: str):
        super().__init__(base, job)
        self.weights, self.lora, self.base_dir = weights, lora, base_dir
        self.off = False  # inside disable_adapter: the base alone

    def routing(self) -> Routing:
        return Routing() if self.off else Routing([(self.job, slice(None))])

    @contextlib.contextmanager
    def disable_adapter(self):
        before, self.off = self.off, True
        try:
            yield
        finally:
            self.off = before

    def __call__(self, **inputs):
        with self.base.routed(self.routing()):
            return self.base.model(**inputs)

    def generate(self, **inputs):
        with self.base.routed(self.routing()):
            return self.base.model.generate(**inputs)

    @property
    def config(self):
        return self.base.model.config

    def parameters(self):
        return self.base.model.parameters()

    def named_parameters(self):
        for module, w in self.weights.items():
            yield f"{PREFIX}{module}.lora_A.default.weight", w.A
            yield f"{PREFIX}{module}.lora_B.default.weight", w.B

    def save_pretrained(self, out, **_) -> None:
        save_peft_adapter(self.weights, self.lora, self.base_dir, Path(out))


class SessionMember(SessionCalls):
    def __init__(self, spec: TrainerSpec, base: SharedBase, tokenizer, vocab: int, device: str) -> None:
        s = spec.request.session
        assert s is not None, "a session job carries its session"
        self.spec, self.name, self.device = spec, spec.job, device
        self.tokenizer, self.vocab = tokenizer, vocab
        seed = s.seed if s.seed is not None else secrets.randbits(63)
        lora = LoraConfig(r=s.rank, alpha=float(s.rank), target_modules=s.target_modules())  # alpha = rank, as alone
        weights = base.attach(self.name, lora, seed)
        self.model = MemberModel(base, self.name, weights, lora, spec.request.base_dir)
        self.params = [p for w in weights.values() for p in (w.A, w.B)]  # peft's order: a state loads either way
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.rng = torch.get_rng_state()
        self.cuda_rng = _cuda_state(device, seed)
        try:
            with self.own_random_state():
                self._begin(spec)
        except BaseException:
            base.detach(self.name)
            raise

    @property
    def attempt(self) -> int:
        return self.spec.attempt

    @contextlib.contextmanager
    def own_random_state(self):
        """Inside: the process's random state is this member's (sampling without a seed draws from it alone)."""
        devices = [torch.cuda.current_device()] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng)
            try:
                yield
            finally:
                self.rng = torch.get_rng_state()
                if self.cuda_rng is not None:
                    self.cuda_rng = torch.cuda.get_rng_state()

    def adapter_weights(self) -> Weights:
        return peft_state_dict(self.model.weights)

    def load_weights(self, weights: Weights) -> None:
        """Weights under peft's saved names into this member's LoRA (the device and dtype its own)."""
        names = [f"{PREFIX}{module}.lora_{ab}.weight" for module in self.model.weights for ab in "AB"]
        if missing := [name for name in names if name not in weights]:
            raise JobError(f"the saved adapter has no weights for {missing[0]} ({len(missing)} missing): it was saved "
                           "by a session of another LoraConfig (train_attn, train_mlp, train_unembed)")  # fmt: skip
        with torch.no_grad():
            for module, w in self.model.weights.items():
                w.A.copy_(weights[f"{PREFIX}{module}.lora_A.weight"])
                w.B.copy_(weights[f"{PREFIX}{module}.lora_B.weight"])

    def emit(self, event) -> None:
        emit(GroupEvent(job=self.spec.job, attempt=self.spec.attempt, event=event))


def _cuda_state(device: str, seed: int) -> torch.Tensor | None:
    if device != "cuda":
        return None
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.cuda.manual_seed(seed)
        return torch.cuda.get_rng_state()
