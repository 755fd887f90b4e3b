"""`python -m trainer JOB.json` for a training session (train.method session): load the base and a fresh LoRA, say
Started, then take calls one at a time from stdin (SessionLine) and print each answer (SessionAnswer) beside the
events a trainer prints. It ends when asked to stop (its adapter saved: the job's artifact), to pause (a checkpoint),
or when no call came for the session's idle_s (a checkpoint too: the job pauses, its device is freed, and the next
call resumes it from there). Saved states are checkpoints the agent stores: a session whose node dies goes on from
the last one elsewhere."""

from __future__ import annotations

import contextlib
import math
import queue
import sys
import threading
import time
from pathlib import Path

import msgspec
import torch

from schemas.events import Checkpoint, Finished, Progress, Started, TrainerSpec
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
    SessionAnswer,
    SessionLine,
    SessionReply,
    StepResult,
)
from trainer import model as base_model
from trainer import session_model as ops
from trainer.session_store import SessionStore
from trainer.errors import JobError
from trainer.events import emit
from trainer.signals import Signals

LINE = msgspec.json.Decoder(SessionLine)
POLL_S = 0.2


class Session:
    """The base with its one trainable adapter, its optimizer, and what it saved."""

    def __init__(self, spec: TrainerSpec) -> None:
        from peft import LoraConfig, get_peft_model

        req, s = spec.request, spec.request.session
        assert s is not None, "a session job carries its session"
        self.spec, self.out = spec, Path(spec.out_dir)
        self.device = spec.device if spec.device == "cpu" or torch.cuda.is_available() else "cpu"
        dtype = base_model.pick_dtype(req.train.precision, self.device)
        self.tokenizer, model = base_model.load(req.base_dir, self.device, dtype, req.quantization)
        if s.seed is not None:
            torch.manual_seed(s.seed)
        config = LoraConfig(r=s.rank, lora_alpha=s.rank, target_modules=s.target_modules(), bias="none")
        self.model = get_peft_model(model, config)  # alpha = rank: the update's scale is 1 whatever the rank
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        self.step, self.last_loss, self.tokens = 0, None, 0
        self.store = SessionStore(self.out / "session")
        self.snapshots: dict[str, dict[str, torch.Tensor]] = {}  # sampler saves, to sample with
        if spec.resume_from:  # its own checkpoint (moved, or resumed after idling): its saves come back too
            self.store.restore(Path(spec.resume_from))
            self.step = ops.load_state(self.model, self.optimizer, self.store.current, with_optimizer=True)
            self.snapshots = self.store.samplers()
        elif spec.init_adapter and s.start_from is not None:  # a state another session of the tenant saved
            path = Path(spec.init_adapter) / "states" / s.start_from.name
            if not (path / "trainer_state.pt").is_file():
                raise JobError(f"session.start_from: the stored checkpoint holds no state {s.start_from.name!r}")
            self.step = ops.load_state(self.model, self.optimizer, path, with_optimizer=s.start_from.optimizer)

    def call(self, call) -> SessionReply:
        if isinstance(call, ForwardBackward):
            ops.check_batch(call, self.vocab)
            self.model.train()
            logprobs, loss, weighed = ops.forward_backward(self.model, call, self.device)
            if not call.forward_only and math.isfinite(loss):
                self.last_loss, self.tokens = loss / max(1, weighed), self.tokens + weighed
            return ForwardResult(logprobs=logprobs, loss=loss, tokens=weighed)
        if isinstance(call, OptimStep):
            norm = ops.optim_step(self.optimizer, self.params, call)
            self.step += 1
            emit(Progress(step=self.step, steps=0, loss=self.last_loss, lr=call.learning_rate, grad_norm=norm,
                          tokens=self.tokens, ts=time.time()))  # fmt: skip
            return StepResult(step=self.step, grad_norm=norm, learning_rate=call.learning_rate)
        if isinstance(call, SaveWeights):
            return self.save(call)
        if isinstance(call, LoadWeights):
            path = self.store.state(call.name)
            if not (path / "trainer_state.pt").is_file():
                raise ops.CallRefused(f"this session saved no state named {call.name!r}", "path")
            self.step = ops.load_state(self.model, self.optimizer, path, call.optimizer)
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
        arch = str(getattr(self.model.config, "model_type", ""))
        rank = self.spec.request.session.rank if self.spec.request.session else 0
        return PingResult(step=self.step, rank=rank, base_model=req.model, tokenizer_dir=req.base_dir, arch=arch)

    def save(self, call: SaveWeights) -> SavedResult:
        if call.kind == "state":
            ops.save_state(self.model, self.optimizer, self.step, self.store.state(call.name))
            self.store.keep_current(call.name)
            emit(Checkpoint(step=self.step, path=str(self.store.root)))  # stored by the agent, every save with it
        else:
            from peft import get_peft_model_state_dict

            weights = get_peft_model_state_dict(self.model)
            self.snapshots[call.name] = {k: v.detach().clone() for k, v in weights.items()}
            self.model.save_pretrained(self.store.sampler(call.name), safe_serialization=True)
            self.store.prune(self.snapshots)
        return SavedResult(name=call.name, kind=call.kind, step=self.step)

    @contextlib.contextmanager
    def weights(self, name: str | None):
        """The model as a sampler save left it (name), the base alone (BASE_WEIGHTS) or as it is now (None)."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        self.model.eval()
        if name is None:
            yield
        elif name == BASE_WEIGHTS:
            with self.model.disable_adapter():
                yield
        elif name not in self.snapshots:
            raise ops.CallRefused(f"this session saved no sampler weights named {name!r}", "model_path")
        else:
            now = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}
            set_peft_model_state_dict(self.model, self.snapshots[name])
            try:
                yield
            finally:
                set_peft_model_state_dict(self.model, now)

    def end(self, pause: bool, why: str = "") -> Finished:
        """Stopped: the adapter as it is now; paused (asked, or idle): a checkpoint to go on from."""
        if pause:
            ops.save_state(self.model, self.optimizer, self.step, self.store.current)
            emit(Checkpoint(step=self.step, path=str(self.store.root)))
            return Finished(state="paused", step=self.step, adapter_dir=str(self.store.root), message=why)
        from trainer.samples import probe

        adapter = self.out / "adapter"
        self.model.save_pretrained(adapter, safe_serialization=True)
        fingerprint = probe(self.model, self.tokenizer, self.device)  # what an engine that serves it must answer
        return Finished(state="stopped", step=self.step, adapter_dir=str(adapter), probe=fingerprint)


def read_lines(lines: queue.Queue) -> None:
    """stdin's lines, into the queue; None when it closes (the agent went away)."""
    for raw in sys.stdin.buffer:
        lines.put(raw)
    lines.put(None)


def answer(session: Session, raw: bytes) -> None:
    try:
        line = LINE.decode(raw)
    except msgspec.ValidationError as e:
        print(f"a call that does not decode: {e}", file=sys.stderr, flush=True)
        return
    try:
        reply: SessionReply = session.call(line.call)
    except ops.CallRefused as e:
        reply = CallError(message=str(e), field=e.field)
    except Exception as e:  # one call's failure is its own: the session goes on
        print(f"a call failed: {e!r}", file=sys.stderr, flush=True)
        reply = CallError(message=f"the call failed: {type(e).__name__}: {e}")
    emit(SessionAnswer(id=line.id, reply=reply))


def serve(spec: TrainerSpec, signals: Signals) -> Finished:
    session = Session(spec)
    idle_s = spec.request.session.idle_s if spec.request.session else 900.0
    note = f"; resumed from step {session.step}" if spec.resume_from or spec.init_adapter else ""
    emit(Started(steps=0, examples=0, device=session.device, message=f"session ready{note}"))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(lines,), daemon=True).start()
    last = time.monotonic()
    while not signals.asked:
        try:
            raw = lines.get(timeout=POLL_S)
        except queue.Empty:
            if time.monotonic() - last > idle_s:  # nobody calls: free the device, go on from here when called
                why = f"no call for {idle_s:.0f} s: checkpointed at step {session.step}; the next call resumes it"
                return session.end(pause=True, why=why)
            continue
        if raw is None:
            return session.end(pause=True, why="the agent closed the session's input")
        answer(session, raw)
        last = time.monotonic()
    return session.end(pause=signals.pause)
