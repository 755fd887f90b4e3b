"""What a training session does with each call, whatever holds its adapter: a session alone (trainer/session.py: a
peft model of its own) or a member of a session group (trainer/session_member.py: its LoRA on a base shared with
other sessions). Forward and backward, optimizer steps, saves of state and of sampler weights (what a checkpoint
carries, so a session resumed after idling or moved after its node died loads and samples them still), loading,
sampling with the base alone, a saved sampler or the adapter as it is, and its end (stopped: the adapter saved;
paused: a checkpoint to go on from)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from schemas.events import Checkpoint, Finished, Progress, TrainerSpec
from schemas.sessions import (
    BASE_WEIGHTS,
    CallError,
    Forget,
    ForgotResult,
    ForwardBackward,
    ForwardResult,
    LoadedResult,
    LoadWeights,
    OptimStep,
    Ping,
    PingResult,
    Sample,
    SampleResult,
    SavedResult,
    SaveWeights,
    SessionReply,
    StepResult,
)
from trainer import session_model as ops
from trainer.errors import JobError
from trainer.session_store import SessionStore

Weights = dict[str, torch.Tensor]  # an adapter's weights under peft's saved names (get_peft_model_state_dict's)


class SessionCalls:
    """One session's adapter, optimizer, step and saves, and the calls on them. A subclass sets `model` (callable
    as a causal LM, with train/eval, disable_adapter, generate, save_pretrained), `params`, `tokenizer`, `vocab`
    and `device`, then calls `_begin`; and says how the adapter's weights are read and written (`adapter_weights`,
    `load_weights`) and where its events go (`emit`)."""

    spec: TrainerSpec
    model: Any  # a peft model, or a member's view of the shared base (session_member.MemberModel)
    params: list[torch.nn.Parameter]
    tokenizer: object
    vocab: int
    device: str

    def _begin(self, spec: TrainerSpec) -> None:
        """The optimizer and the saves; the state a resumed (or moved) session goes on from, or the one another
        session of the tenant saved that it starts from."""
        s = spec.request.session
        assert s is not None, "a session job carries its session"
        self.optimizer = torch.optim.AdamW(
            self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, foreach=True
        )  # foreach: one call over the adapter's tensors, not a Python loop over them (on CPU too)
        self.last_loss: float | None = None  # the latest training forward's mean loss
        self.step, self.tokens = 0, 0
        self.out = Path(spec.out_dir)
        self.store = SessionStore(self.out / "session")
        self.snapshots: dict[str, Weights] = {}  # sampler saves, to sample with
        if spec.resume_from:  # its own checkpoint (moved, or resumed after idling): its saves come back too
            self.store.restore(Path(spec.resume_from))
            self.step = ops.load_state(self.load_weights, self.optimizer, self.store.current, with_optimizer=True)
            ops.load_pending_grads(self.model, self.store.current)  # a pause between forward_backward and its step
            self.snapshots = self.store.samplers()
        elif spec.init_adapter and s.start_from is not None:  # a state another session of the tenant saved
            path = Path(spec.init_adapter) / "states" / s.start_from.name
            if not (path / "trainer_state.pt").is_file():
                raise JobError(f"session.start_from: the stored checkpoint holds no state {s.start_from.name!r}")
            self.step = ops.load_state(self.load_weights, self.optimizer, path, with_optimizer=s.start_from.optimizer)

    # --- what a subclass says --------------------------------------------------------------------------------------
    def adapter_weights(self) -> Weights:
        raise NotImplementedError

    def load_weights(self, weights: Weights) -> None:
        raise NotImplementedError

    def emit(self, event) -> None:
        raise NotImplementedError

    # --- the calls -------------------------------------------------------------------------------------------------
    def call(self, call) -> SessionReply:
        if isinstance(call, ForwardBackward):
            ops.check_batch(call, self.vocab)
            self.model.train()
            logprobs, loss, weighed = ops.forward_backward(self.model, call, self.device)
            return self.took(call, logprobs, loss, weighed)
        if isinstance(call, OptimStep):
            norm = ops.optim_step(self.optimizer, self.params, call)
            self.step += 1
            self.emit(Progress(step=self.step, steps=0, loss=self.last_loss, lr=call.learning_rate, grad_norm=norm,
                               tokens=self.tokens, ts=time.time()))  # fmt: skip
            return StepResult(step=self.step, grad_norm=norm, learning_rate=call.learning_rate)
        if isinstance(call, SaveWeights):
            return self.save(call)
        if isinstance(call, LoadWeights):
            path = self.store.state(call.name)
            if not (path / "trainer_state.pt").is_file():
                raise ops.CallRefused(f"this session saved no state named {call.name!r}", "path")
            self.step = ops.load_state(self.load_weights, self.optimizer, path, call.optimizer)
            return LoadedResult(name=call.name, step=self.step)
        if isinstance(call, Sample):
            if not call.prompt or min(call.prompt) < 0 or max(call.prompt) >= self.vocab:
                raise ops.CallRefused(f"prompt: give 1 or more tokens, each in 0..{self.vocab - 1}", "prompt")
            with self.weights(call.weights):
                sequences = ops.sample(self.model, self.tokenizer, call, self.device)
                first, rest = call.prompt[:1], call.prompt[1:]
                prompt = ops.scored(self.model, first, rest, self.device) if call.prompt_logprobs else None
            return SampleResult(sequences=sequences, prompt_logprobs=prompt)
        if isinstance(call, Forget):
            if call.kind == "sampler":
                self.snapshots.pop(call.name, None)
            if not self.store.forget(call.name, call.kind):
                raise ops.CallRefused(f"this session has no {call.kind} save named {call.name!r}", "checkpoint")
            return ForgotResult(name=call.name, kind=call.kind)
        assert isinstance(call, Ping)
        req = self.spec.request
        rank = req.session.rank if req.session else 0
        return PingResult(step=self.step, rank=rank, base_model=req.model, tokenizer_dir=req.base_dir, arch=self.arch)

    def took(self, call: ForwardBackward, logprobs: list, loss: float, weighed: int) -> ForwardResult:
        """A forward (and backward) done, here or in a group's shared pass: what the next progress event says."""
        if not call.forward_only and math.isfinite(loss):
            self.last_loss, self.tokens = loss / max(1, weighed), self.tokens + weighed
        return ForwardResult(logprobs=logprobs, loss=loss, tokens=weighed)

    @property
    def arch(self) -> str:
        return str(getattr(getattr(self.model, "config", None), "model_type", ""))

    def save(self, call: SaveWeights) -> SavedResult:
        if call.kind == "state":
            ops.save_state(self.model, self.optimizer, self.step, self.store.state(call.name))
            self.store.keep_current(call.name)
            self.emit(Checkpoint(step=self.step, path=str(self.store.root)))  # stored by the agent, every save with it
        else:
            self.snapshots[call.name] = {k: v.detach().clone() for k, v in self.adapter_weights().items()}
            self.model.save_pretrained(self.store.sampler(call.name), safe_serialization=True)
            self.store.prune(self.snapshots)
        return SavedResult(name=call.name, kind=call.kind, step=self.step)

    @contextlib.contextmanager
    def weights(self, name: str | None):
        """The model as a sampler save left it (name), the base alone (BASE_WEIGHTS) or as it is now (None)."""
        self.model.eval()
        if name is None:
            yield
        elif name == BASE_WEIGHTS:
            with self.model.disable_adapter():
                yield
        elif name not in self.snapshots:
            raise ops.CallRefused(f"this session saved no sampler weights named {name!r}", "model_path")
        else:
            now = {k: v.detach().clone() for k, v in self.adapter_weights().items()}
            self.load_weights(self.snapshots[name])
            try:
                yield
            finally:
                self.load_weights(now)

    def end(self, pause: bool, why: str = "") -> Finished:
        """Stopped: the adapter as it is now; paused (asked, or idle): a checkpoint to go on from."""
        if pause:  # the gradients of forward_backwards not yet stepped go with it: the next optim_step takes them
            ops.save_state(self.model, self.optimizer, self.step, self.store.current)
            ops.save_pending_grads(self.model, self.store.current)
            self.emit(Checkpoint(step=self.step, path=str(self.store.root)))
            return Finished(state="paused", step=self.step, adapter_dir=str(self.store.root), message=why)
        from trainer.samples import probe

        adapter = self.out / "adapter"
        self.model.save_pretrained(adapter, safe_serialization=True)
        fingerprint = probe(self.model, self.tokenizer, self.device)  # what an engine that serves it must answer
        return Finished(state="stopped", step=self.step, adapter_dir=str(adapter), probe=fingerprint)


def reply_to(session: SessionCalls, call) -> SessionReply:
    """The session's answer to a call; one that is refused or fails is answered so (the session goes on)."""
    try:
        return session.call(call)
    except ops.CallRefused as e:
        return CallError(message=str(e), field=e.field)
    except Exception as e:  # one call's failure is its own
        print(f"a call failed: {e!r}", file=sys.stderr, flush=True)
        return CallError(message=f"the call failed: {type(e).__name__}: {e}")
