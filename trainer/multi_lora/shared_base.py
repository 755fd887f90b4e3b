"""The frozen base model that every job of a group trains its adapter on: its targeted linear layers wrapped once,
each job's LoRA attached to and detached from them, and the model's output for a batch whose rows are routed to
their jobs' adapters."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch

from trainer.multi_lora.layer import LoraWeights, MultiLoraLinear, Routing, RoutingHolder
from trainer.multi_lora.varlen import Layout, flat_attention
from trainer.errors import JobError
from trainer.objectives.losses import output_head

if TYPE_CHECKING:
    from trainer.model import CausalLM

INITS = ("default", "gaussian")  # pissa and loftq change the base's weights: no base shared with other jobs


def targets(name: str, target_modules) -> bool:
    """Whether the module `name` is one of `target_modules`, as peft matches a list: the whole name or its end."""
    return any(name == t or name.endswith(f".{t}") for t in target_modules)


class SharedBase:
    """The base model, frozen, with the LoRA of each job attached under the job's name."""

    def __init__(self, model: CausalLM, autocast_dtype: torch.dtype = torch.float32) -> None:
        model.requires_grad_(False)
        self.model = model
        self.model.train()
        self.autocast_dtype = autocast_dtype
        self.routing = RoutingHolder()
        self.head = output_head(model)
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}  # in model order
        self.wrapped: dict[str, MultiLoraLinear] = {}

    def attach(self, job: str, lora, seed: int) -> dict[str, LoraWeights]:
        """Give the job a LoRA (a schemas LoraConfig) on each layer it targets, started as peft starts one after
        set_seed(seed): per layer in model order, A and B made as nn.Linear then A re-initialised, B zero. The
        global random state is left as it was, so that a job joining never changes its neighbours' draws."""
        if lora.init not in INITS:
            raise JobError(f"lora.init {lora.init} changes the base's weights; a co-trained job uses one of {INITS}")
        names = [n for n in self.linears if targets(n, lora.target_modules)]
        if not names:
            raise JobError(f"lora.target_modules {list(lora.target_modules)} match no linear layer of this model")
        scaling = lora.alpha / (math.sqrt(lora.r) if lora.rslora else lora.r)
        made: dict[str, LoraWeights] = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for name in names:
                layer = self._wrap(name)
                A, B = _peft_start(layer.base_layer, lora.r, lora.init)
                generator = torch.Generator(A.device).manual_seed(seed) if lora.dropout else None
                made[name] = LoraWeights(A, B, scaling, lora.dropout, generator)
                layer.adapters[job] = made[name]
        return made

    def detach(self, job: str) -> None:
        """Take the job's LoRA off every layer: its rows, if any came, would get the base alone."""
        for layer in self.wrapped.values():
            layer.adapters.pop(job, None)

    def _wrap(self, name: str) -> MultiLoraLinear:
        if name not in self.wrapped:
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            self.wrapped[name] = MultiLoraLinear(getattr(parent, child), self.routing)
            setattr(parent, child, self.wrapped[name])
        return self.wrapped[name]

    @contextmanager
    def routed(self, routing: Routing):
        """Batches going through the model in this block are routed so (the routing before comes back after)."""
        before, self.routing.now = self.routing.now, routing
        try:
            yield
        finally:
            self.routing.now = before

    def output(self, batch, flat: Layout | None = None) -> torch.Tensor:
        """The model's output for the batch as routed now: the last hidden state where the output projection is
        plain (the losses take it through the projection a chunk at a time), else the logits. `flat`: the batch is
        the group's flat layout, attended piece by piece (trainer/multi_lora/varlen.py)."""
        inputs = dict(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            use_cache=False,
        )
        half = self.autocast_dtype != torch.float32
        attending = flat_attention(self.model, flat) if flat is not None else nullcontext()
        with (
            attending,
            torch.autocast(device_type=batch.input_ids.device.type, dtype=self.autocast_dtype, enabled=half),
        ):
            if self.head:
                return self.head.decoder(**inputs).last_hidden_state
            return self.model(**inputs).logits


def _peft_start(base_layer: torch.nn.Linear, r: int, init: str) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """A and B as peft's LoraLayer.update_layer makes them (the same random draws, in the same order), in fp32 on
    the base layer's device."""
    lora_A = torch.nn.Linear(base_layer.in_features, r, bias=False)
    lora_B = torch.nn.Linear(r, base_layer.out_features, bias=False)
    if init == "gaussian":
        torch.nn.init.normal_(lora_A.weight, std=1 / r)
    else:
        torch.nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5))
    torch.nn.init.zeros_(lora_B.weight)
    device = base_layer.weight.device
    return torch.nn.Parameter(lora_A.weight.to(device)), torch.nn.Parameter(lora_B.weight.to(device))


class JobView:
    """One job's adapter on the shared base, for code that takes a job's own PEFT model (evaluation, samples, the
    losses of trainer/objectives/objective.py): inside `active()` every row goes through this job's adapter, and
    disable_adapter() is the base alone (dpo's reference)."""

    peft_config: dict = {}  # no frozen starting adapter: the reference is the base

    def __init__(self, base: SharedBase, job: str) -> None:
        self.base, self.job = base, job

    def get_base_model(self) -> torch.nn.Module:
        return self.base.model

    @property
    def training(self) -> bool:
        return self.base.model.training

    def eval(self) -> None:
        self.base.model.eval()

    def train(self) -> None:
        self.base.model.train()

    def active(self):
        return self.base.routed(Routing([(self.job, slice(None))]))

    def disable_adapter(self):
        return self.base.routed(Routing())

    @property
    def base_model(self) -> "JobView":
        """peft's LoraModel's place: where trainer/objectives/dpo.py switches the adapter off and on."""
        return self

    def disable_adapter_layers(self) -> None:
        self._before, self.base.routing.now = self.base.routing.now, Routing()

    def enable_adapter_layers(self) -> None:
        self.base.routing.now = self._before

    def __call__(self, **inputs):
        with self.active():
            return self.base.model(**inputs)
