"""`python -m trainer JOB.json` for a training session (train.method session): load the base and a fresh LoRA, say
Started, then take calls one at a time from stdin (SessionLine) and print each answer (SessionAnswer) beside the
events a trainer prints. It ends when asked to stop (its adapter saved: the job's artifact), to pause (a checkpoint),
or when no call came for the session's idle_s (a checkpoint too: the job pauses, its device is freed, and the next
call resumes it from there). Saved states are checkpoints the agent stores: a session whose node dies goes on from
the last one elsewhere."""

from __future__ import annotations

import queue
import sys
import threading
import time

import msgspec
import torch

from schemas.events import Finished, Started, TrainerSpec
from schemas.sessions import SessionAnswer, SessionLine
from trainer import model as base_model
from trainer.events import emit
from trainer.session.calls import SessionCalls, Weights
from trainer.signals import Signals

LINE = msgspec.json.Decoder(SessionLine)
POLL_S = 0.2


class Session(SessionCalls):
    """The base with its one trainable adapter (a peft model of its own), its optimizer, and what it saved."""

    def __init__(self, spec: TrainerSpec) -> None:
        from peft import LoraConfig, get_peft_model

        req, s = spec.request, spec.request.session
        assert s is not None, "a session job carries its session"
        self.spec = spec
        self.device = spec.device if spec.device == "cpu" or torch.cuda.is_available() else "cpu"
        dtype = base_model.pick_dtype(req.train.precision, self.device)
        self.tokenizer, model = base_model.load(req.base_dir, self.device, dtype, req.quantization)
        if s.seed is not None:
            torch.manual_seed(s.seed)
        config = LoraConfig(r=s.rank, lora_alpha=s.rank, target_modules=s.target_modules(), bias="none")
        self.model = get_peft_model(model, config)  # alpha = rank: the update's scale is 1 whatever the rank
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        self._begin(spec)

    def adapter_weights(self) -> Weights:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.model)

    def load_weights(self, weights: Weights) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, weights)

    def emit(self, event) -> None:
        emit(event)


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
    emit(SessionAnswer(id=line.id, reply=session.take(line.call, line.call_id)))
    session.said()


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
