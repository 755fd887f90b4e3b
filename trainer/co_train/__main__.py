"""`python -m trainer.co_train`: a co-training group's trainer; the agent writes GroupControl lines on its stdin
(jobs joining, cancelled, stopped, paused) and reads GroupEvent lines from its stdout (trainer/co_train/process.py)."""

from __future__ import annotations

import os
import signal
import sys

# a job of a group is stopped or paused by a line on stdin: a stray signal meant for a trainer alone ends nothing
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
signal.signal(signal.SIGUSR2, signal.SIG_IGN)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from trainer.co_train.process import serve  # noqa: E402 (after the environment above, which the libraries read)

if __name__ == "__main__":
    code = 1
    try:
        code = serve(sys.stdin.buffer)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # at once: the thread reading stdin may be blocked in it, which a normal exit aborts on
