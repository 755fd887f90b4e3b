"""The co-training group's trainer process (`python -m trainer.co_train`), driven as the agent drives it: jobs
join by a line on stdin; one runs to its end with a checkpoint on the way, one is stopped, one paused and resumed
from its checkpoint in the same group (ending where a run never paused ends), one cancelled; in an fp16 group one
whose loss stops being a number fails alone. Each writes what a trainer alone writes into its own directory."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from schemas.events import Checkpoint, Failed, Finished, GroupControl, GroupEvent, Progress, Started
from tests.test_co_train import ATTN, MLP, job_spec

DEADLINE_S = 60.0
ROOT = Path(__file__).resolve().parent.parent


class GroupProcess:
    """The group's process, its events gathered by job as they come."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.co_train"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        self.events: dict[str, list] = {}
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(b"{"):  # as the agent reads it: a library's stray print is no event
                ev = msgspec.json.decode(line, type=GroupEvent)
                with self.changed:
                    self.events.setdefault(ev.job, []).append(ev.event)
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()  # the process's end: nothing more comes

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "the process runs"
        assert self.proc.stderr is not None
        return f"the process exited {self.proc.returncode}: {self.proc.stderr.read().decode()[-3000:]}"

    def send(self, action: str, job: str, spec=None) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(GroupControl(action=action, job=job, spec=spec)) + b"\n")
        self.proc.stdin.flush()

    def last(self, job: str):
        """The job's last event (Finished or Failed), waited for."""
        ended = lambda: any(isinstance(e, (Finished, Failed)) for e in self.events.get(job, []))  # noqa: E731
        with self.changed:
            ok = self.changed.wait_for(lambda: ended() or self.proc.poll() is not None, DEADLINE_S)
        assert ok and ended(), f"job {job} did not end: {self.events.get(job)}; {self.stderr()}"
        return self.events[job][-1]


def spec(tiny_model, tmp, name: str, lora: dict | None = None, **train):
    """A short sft job (fp32 unless told)."""
    lora = lora or dict(r=4, alpha=8, target_modules=ATTN + MLP)
    return job_spec(tiny_model, tmp, name, lora, {"max_steps": 4, **train})


def overflowing(tiny_model, tmp, name: str):
    """A job whose fp16 activations overflow within a few steps: a huge LoRA scale at the highest learning rate a
    request may ask, unclipped. Its loss stops being a number."""
    lora = dict(r=1, alpha=8192, target_modules=ATTN + MLP)
    return spec(tiny_model, tmp, name, lora, max_steps=10, learning_rate=1.0, max_grad_norm=0.0, precision="fp16")


def test_a_job_whose_loss_is_not_a_number_fails_and_its_neighbour_trains_on(tiny_model, tmp_path):
    group = GroupProcess()
    try:
        group.send("add", "ok", spec(tiny_model, tmp_path, "ok", precision="fp16"))
        group.send("add", "n", overflowing(tiny_model, tmp_path, "n"))
        assert group.proc.stdin is not None
        group.proc.stdin.close()
        ok, bad = group.last("ok"), group.last("n")
        assert group.proc.wait(timeout=DEADLINE_S) == 0
    finally:
        group.proc.kill()
    assert isinstance(bad, Failed) and "the loss became nan" in bad.message and "train.learning_rate" in bad.message
    assert isinstance(ok, Finished) and ok.state == "trained" and ok.step == 4, ok


@pytest.mark.timeout(240)
def test_jobs_join_end_stop_pause_resume_and_cancel_alone_in_one_process(tiny_model, tmp_path):
    group = GroupProcess()
    try:
        group.send("add", "a", spec(tiny_model, tmp_path, "a", save_steps=2))
        group.send("add", "s", spec(tiny_model, tmp_path, "s"))
        group.send("stop", "s")  # before its first step: it ends after it, its adapter saved
        group.send("add", "p", spec(tiny_model, tmp_path, "p"))
        group.send("pause", "p")
        group.send("add", "x", spec(tiny_model, tmp_path, "x"))
        group.send("cancel", "x")

        paused = group.last("p")
        assert isinstance(paused, Finished) and paused.state == "paused" and paused.step == 1, paused
        checkpoint = Path(paused.adapter_dir).parent
        resumed = msgspec.structs.replace(spec(tiny_model, tmp_path, "p2"), resume_from=str(checkpoint))
        group.send("add", "p2", resumed)  # its own directory: as a resumed attempt on another node
        group.send("add", "ref", spec(tiny_model, tmp_path, "ref"))  # p, never paused
        assert group.proc.stdin is not None
        group.proc.stdin.close()  # no job joins any more: the process ends once the last one does

        done = {job: group.last(job) for job in ("a", "s", "p2", "ref")}
        assert group.proc.wait(timeout=DEADLINE_S) == 0
    finally:
        group.proc.kill()
    assert done["a"].state == "trained" and done["a"].step == 4 and done["a"].probe is not None
    assert done["s"].state == "stopped" and done["s"].step == 1, done["s"]
    assert "x" not in group.events or not any(isinstance(e, (Finished, Failed)) for e in group.events["x"])
    events_a = group.events["a"]
    assert isinstance(events_a[0], Started)
    assert [e.step for e in events_a if isinstance(e, Progress)] == [1, 2, 3, 4]
    assert [e.step for e in events_a if isinstance(e, Checkpoint)] == [2]
    assert (tmp_path / "a" / "out" / "checkpoints" / "step-2" / "trainer_state.pt").is_file()
    for job in ("a", "s", "p2", "ref"):
        assert (Path(done[job].adapter_dir) / "adapter_config.json").is_file()
    assert "resumed from step 1" in group.events["p2"][0].message
    assert done["p2"].state == "trained" and done["p2"].step == 4
    got = load_file(str(Path(done["p2"].adapter_dir) / "adapter_model.safetensors"))
    want = load_file(str(Path(done["ref"].adapter_dir) / "adapter_model.safetensors"))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)
