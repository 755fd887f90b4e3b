"""A stand-in trainer for control-plane tests: speaks the trainer's event protocol, holds for HOLD_S seconds.

It writes a small adapter directory so the agent's artifact path is exercised; the real
trainer is tested in test_trainer.py and end to end in test_end_to_end.py.
"""

import os
import sys
import time
from pathlib import Path

import msgspec

from schemas.events import Checkpoint, Finished, Progress, Started, TrainerSpec
from trainer import lease
from trainer.signals import Signals

signals = Signals()  # SIGUSR1 stops, SIGUSR2 pauses, as the real trainer's
spec = msgspec.json.decode(Path(sys.argv[1]).read_bytes(), type=TrainerSpec)
hold = float(os.environ.get("HOLD_S", "0.5"))
if os.environ.get("HOLD_CRASH"):
    print("simulated crash: CUDA error: out of memory", file=sys.stderr)
    sys.exit(3)
steps = int(os.environ.get("HOLD_STEPS", "10"))
print(msgspec.json.encode(Started(steps=steps, examples=len(spec.request.data))).decode(), flush=True)
step = 0
if spec.resume_from:  # a resumed job goes on from its checkpoint's step
    step = int((Path(spec.resume_from) / "step").read_text())
t0 = time.monotonic()
marks = os.environ.get("HOLD_LOG")  # a file the fault tests read: which attempt computed which step, when


def mark(step: int) -> None:
    if marks:
        with open(marks, "a") as f:
            f.write(f"{spec.job} {spec.attempt} {step} {time.time():.3f} {os.getpid()}\n")


while step < steps and not signals.asked:
    time.sleep(hold / steps)
    lease.hold_while_lapsed()  # as the real trainer does before each step
    step += 1
    mark(step)
    print(
        msgspec.json.encode(
            Progress(step=step, steps=steps, loss=1.0 / step, elapsed_s=time.monotonic() - t0)
        ).decode(),
        flush=True,
    )
if signals.pause:
    checkpoint = Path(spec.out_dir) / "checkpoints" / f"step-{step}"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "step").write_text(str(step))
    print(msgspec.json.encode(Checkpoint(step=step, path=str(checkpoint))).decode(), flush=True)
    print(msgspec.json.encode(Finished(state="paused", step=step, adapter_dir=str(checkpoint))).decode(), flush=True)
    sys.exit(0)
out = Path(spec.out_dir) / "adapter"
out.mkdir(parents=True, exist_ok=True)
(out / "adapter_config.json").write_text('{"r": 1}')
gguf = None
if spec.request.served_by == "llamacpp":  # a stand-in GGUF: its bytes are what travels, not what an engine reads
    gguf = Path(spec.out_dir) / "adapter.gguf"
    gguf.write_bytes(b"GGUF stand-in of " + spec.job.encode())
state = "stopped" if signals.asked else "trained"
print(
    msgspec.json.encode(Finished(state=state, step=step, adapter_dir=str(out), gguf_path=gguf and str(gguf))).decode(),
    flush=True,
)
