"""A stand-in trainer for control-plane tests: speaks the trainer's event protocol, holds for HOLD_S seconds.

It writes a small adapter directory so the agent's artifact path is exercised; the real
trainer is tested in test_trainer.py and end to end in test_end_to_end.py.
"""

import os
import signal
import sys
import time
from pathlib import Path

import msgspec

from schemas.events import Finished, Progress, Started, TrainerSpec

stop = False


def ask_stop(*_):
    global stop
    stop = True


signal.signal(signal.SIGUSR1, ask_stop)
spec = msgspec.json.decode(Path(sys.argv[1]).read_bytes(), type=TrainerSpec)
hold = float(os.environ.get("HOLD_S", "0.5"))
if os.environ.get("HOLD_CRASH"):
    print("simulated crash: CUDA error: out of memory", file=sys.stderr)
    sys.exit(3)
steps = 10
print(msgspec.json.encode(Started(steps=steps, examples=len(spec.request.data))).decode(), flush=True)
step = 0
t0 = time.monotonic()
while step < steps and not stop:
    time.sleep(hold / steps)
    step += 1
    print(msgspec.json.encode(Progress(step=step, steps=steps, loss=1.0 / step, elapsed_s=time.monotonic() - t0)).decode(),
          flush=True)
out = Path(spec.out_dir) / "adapter"
out.mkdir(parents=True, exist_ok=True)
(out / "adapter_config.json").write_text('{"r": 1}')
state = "stopped" if stop else "trained"
print(msgspec.json.encode(Finished(state=state, step=step, adapter_dir=str(out))).decode(), flush=True)
