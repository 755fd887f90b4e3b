"""What a training session does with each call, whatever holds its adapter: a session alone (trainer/session/serve.py: a
peft model of its own) or a member of a session group (trainer/session/member.py: its LoRA on a base shared with
other sessions). Forward and backward, optimizer steps, saves of state and of sampler weights (what a checkpoint
carries, so a session resumed after idling or moved after its node died loads and samples them still; a named
sampler save goes to the object store instead, read back when sampled), loading, sampling with the base alone, a
saved sampler or the adapter as it is, and its end (stopped: the adapter saved; paused: a checkpoint to go on
from). A call sent again under its call id is answered as it was, never run twice (take, applied_calls.py)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    stored_sampler,
)
from trainer.session import model as ops
from trainer.session import text
from trainer.session.applied_calls import AppliedCalls
from trainer.errors import JobError
from trainer.session.store import SessionStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Weights = dict[str, torch.Tensor]  # an adapter's weights under peft's saved names (get_peft_model_state_dict's)
LOADED_KEPT = 2  # stored sampler saves kept in memory once read back (the one sampled now, and the one before)


class SessionCalls:
    """One session's adapter, optimizer, step and saves, and the calls on them. A subclass sets `model` (callable
    as a causal LM, with train/eval, disable_adapter, generate, save_pretrained), `params`, `tokenizer`, `vocab`
    and `device`, then calls `_begin`; and says how the adapter's weights are read and written (`adapter_weights`,
    `load_weights`) and where its events go (`emit`)."""

    spec: TrainerSpec
    model: Any  # a peft model, or a member's view of the shared base (session_member.MemberModel)
    params: list[torch.nn.Parameter]
    tokenizer: PreTrainedTokenizerBase
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
        self.unsaid: Progress | None = None  # the last optim_step's, until its answer is out (said)
        self.step, self.tokens = 0, 0
        self.out = Path(spec.out_dir)
        self.store = SessionStore(self.out / "session")
        self.snapshots: dict[str, Weights] = {}  # unnamed sampler saves, to sample with
        self.loaded: dict[str, Weights] = {}  # stored (named) sampler saves read back lately, the latest LOADED_KEPT
        self.applied = AppliedCalls()
        if spec.resume_from:  # its own checkpoint (moved, or resumed after idling): its saves come back too
            self.store.restore(Path(spec.resume_from))
            self.step = ops.load_state(self.load_weights, self.optimizer, self.store.current, with_optimizer=True)
            ops.load_pending_grads(self.model, self.store.current)  # a pause between forward_backward and its step
            self.applied.load(self.store.current)  # the calls whose effects that state holds: never run again
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
    def take(self, call, call_id: str = "") -> SessionReply:
        """The answer to a call sent under `call_id`: the one it gave if it ran already (before a pause, or an
        attempt ago), else it runs now; a save_state then stores the whole state, with the calls it holds."""
        self.said()
        known = self.applied.answer(call_id)
        if known is not None:
            return known
        reply = reply_to(self, call)
        self.applied.remember(call_id, call, reply)
        if isinstance(call, SaveWeights) and call.kind == "state" and not isinstance(reply, CallError):
            self.checkpoint()
        return reply

    def said(self) -> None:
        """The Progress of the last optim_step, said once its answer is out: the agent reads a trainer's lines in
        order and stores each Progress (a JetStream round trip) before it reads the next line, so a Progress said
        first held every step's answer back by that round trip."""
        progress, self.unsaid = self.unsaid, None
        if progress is not None:
            self.emit(progress)

    def checkpoint(self) -> None:
        """current/ (the state to go on from) completed with the gradients not yet stepped and the calls applied,
        then stored by the agent, every save with it."""
        ops.save_pending_grads(self.model, self.store.current)
        self.applied.save(self.store.current)
        self.emit(Checkpoint(step=self.step, path=str(self.store.root)))

    def call(self, call) -> SessionReply:
        if isinstance(call, ForwardBackward):
            ops.check_batch(call, self.vocab)
            self.model.train()
            logprobs, loss, weighed = ops.forward_backward(self.model, call, self.device)
            return self.took(call, logprobs, loss, weighed)
        if isinstance(call, OptimStep):
            norm = ops.optim_step(self.optimizer, self.params, call)
            self.step += 1
            self.unsaid = Progress(
                step=self.step,
                steps=0,
                loss=self.last_loss,
                lr=call.learning_rate,
                grad_norm=norm,
                tokens=self.tokens,
                ts=time.time(),
            )  # said after its answer
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
            in_text, call = call.text is not None or call.messages is not None, text.tokenized(self.tokenizer, call)
            if not call.prompt or min(call.prompt) < 0 or max(call.prompt) >= self.vocab:
                raise ops.CallRefused(f"prompt: give 1 or more tokens, each in 0..{self.vocab - 1}", "prompt")
            with self.weights(call.weights, call.stored):
                sequences = ops.sample(self.model, self.tokenizer, call, self.device)
                first, rest = call.prompt[:1], call.prompt[1:]
                prompt = ops.scored(self.model, first, rest, self.device) if call.prompt_logprobs else None
            result = SampleResult(sequences=sequences, prompt_logprobs=prompt)
            return text.with_texts(self.tokenizer, in_text, call, result)
        if isinstance(call, Forget):
            stored = False
            if call.kind == "sampler":
                self.snapshots.pop(call.name, None)
                self.loaded.pop(call.name, None)
                stored = self.store.forget_stored(Path(stored_sampler(self.spec.out_dir, call.name)))
            if not self.store.forget(call.name, call.kind) and not stored:
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
        if call.kind == "state":  # stored with the calls it holds once answered (take)
            ops.save_state(self.model, self.optimizer, self.step, self.store.state(call.name))
            self.store.keep_current(call.name)
        elif call.stored:  # the agent uploads it; read back from there when sampled (stored_weights)
            self.model.save_pretrained(stored_sampler(self.spec.out_dir, call.name), safe_serialization=True)
            self.loaded.pop(call.name, None)  # an older save of that name
        else:
            self.snapshots[call.name] = {k: v.detach().clone() for k, v in self.adapter_weights().items()}
            self.model.save_pretrained(self.store.sampler(call.name), safe_serialization=True)
            self.store.prune(self.snapshots)
        return SavedResult(name=call.name, kind=call.kind, step=self.step)

    def stored_weights(self, name: str) -> Weights:
        """A stored sampler save's weights, read from where the trainer wrote it (or the agent fetched it back)."""
        weights = self.loaded.pop(name, None)
        if weights is None:
            from safetensors.torch import load_file

            path = Path(stored_sampler(self.spec.out_dir, name)) / "adapter_model.safetensors"
            if not path.is_file():
                raise ops.CallRefused(f"no stored sampler weights named {name!r} reached this session", "model_path")
            weights = load_file(str(path), device=self.device)
        self.loaded[name] = weights
        while len(self.loaded) > LOADED_KEPT:
            del self.loaded[next(iter(self.loaded))]
        return weights

    @contextlib.contextmanager
    def weights(self, name: str | None, stored: bool = False):
        """The model as a sampler save left it (name: unnamed ones in memory, stored ones read back), the base
        alone (BASE_WEIGHTS) or as it is now (None)."""
        self.model.eval()
        if name is None:
            yield
        elif name == BASE_WEIGHTS:
            with self.model.disable_adapter():
                yield
        elif name not in self.snapshots and not stored:
            raise ops.CallRefused(f"this session saved no sampler weights named {name!r}", "model_path")
        else:
            swap = self.snapshots[name] if name in self.snapshots else self.stored_weights(name)
            now = {k: v.detach().clone() for k, v in self.adapter_weights().items()}
            self.load_weights(swap)
            try:
                yield
            finally:
                self.load_weights(now)

    def end(self, pause: bool, why: str = "") -> Finished:
        """Stopped: the adapter as it is now; paused (asked, or idle): a checkpoint to go on from."""
        if pause:  # the gradients not yet stepped and the calls applied go with it (checkpoint)
            ops.save_state(self.model, self.optimizer, self.step, self.store.current)
            self.checkpoint()
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
