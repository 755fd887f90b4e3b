"""A trainer's event reaches its agent whole: the agent starts it with PYTHONUNBUFFERED, so its stdout is the raw pipe,
and a write into a full pipe that a signal comes through (a pause's, a stop's) takes only part of the line. The rest
was dropped: the agent read a cut line and the call it answered waited out its 600 s timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, wait_for

CHILD = """
import signal, sys
from trainer.events import emit
signal.signal(signal.SIGUSR1, lambda *_: None)  # as the trainer's pause handler: it returns, the write goes on
emit({"kind": "answer", "body": "x" * (4 << 20)})
"""


def _blocked_writing(pid: int) -> bool:
    try:
        return "pipe_write" in Path(f"/proc/{pid}/wchan").read_text()  # (anon_pipe_write on newer kernels)
    except OSError:
        return False


async def test_a_long_event_written_through_signals_arrives_whole():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
    )
    got = b""
    try:
        for _ in range(3):  # each while the child waits for room in the pipe (or once it has ended)
            await wait_for(
                lambda: _blocked_writing(child.pid) or child.poll() is not None,
                timeout=60,
                interval=0.01,
                what="the child blocked writing into a full pipe",
            )
            if child.poll() is not None:
                break  # it ended: what it wrote is all there is
            child.send_signal(signal.SIGUSR1)
            got += child.stdout.read(1 << 16)  # some room: the write goes on, and fills the pipe again
        got += child.communicate(timeout=60)[0]
    finally:
        child.kill()
    ends = got.count(b"\n")
    assert got.endswith(b"\n") and ends == 1, f"{len(got)} bytes, {ends} line ends"
    assert json.loads(got)["body"] == "x" * (4 << 20)
