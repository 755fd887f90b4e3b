"""The co-training group's trainer process (`python -m trainer.co_train`), driven as the agent drives it: jobs
join by a line on stdin; one runs to its end with a checkpoint on the way, one is stopped, one paused and resumed
from its checkpoint in the same group (ending where a run never paused ends), one cancelled; in an fp16 group one
whose loss stops being a number fails alone. Each writes what a trainer alone writes into its own directory."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from schemas.events import Checkpoint, Failed, Finished, GroupControl, GroupEvent, Progress, Requeue, Started
from tests.test_co_train import ATTN, MLP, job_spec

DEADLINE_S = 60.0
ROOT = Path(__file__).resolve().parent.parent


class GroupProcess:
    """The group's process, its events gathered by job as they come."""

    def __init__(self, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.co_train"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.events: dict[str, list] = {}
        self.attempts: dict[tuple[str, int], list] = {}  # the same events by (job, attempt)
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(b"{"):  # as the agent reads it: a library's stray print is no event
                ev = msgspec.json.decode(line, type=GroupEvent)
                with self.changed:
                    self.events.setdefault(ev.job, []).append(ev.event)
                    self.attempts.setdefault((ev.job, ev.attempt), []).append(ev.event)
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()  # the process's end: nothing more comes

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "the process runs"
        assert self.proc.stderr is not None
        return f"the process exited {self.proc.returncode}: {self.proc.stderr.read().decode()[-3000:]}"

    def send(self, action: str, job: str, spec=None, attempt: int = 0) -> None:
        assert self.proc.stdin is not None
        line = GroupControl(action=action, job=job, spec=spec, attempt=spec.attempt if spec else attempt)
        self.proc.stdin.write(msgspec.json.encode(line) + b"\n")
        self.proc.stdin.flush()

    def wait(self, what: str, predicate) -> None:
        """Until predicate() holds (under the lock the events are gathered with)."""
        with self.changed:
            ok = self.changed.wait_for(lambda: predicate() or self.proc.poll() is not None, DEADLINE_S)
        assert ok and predicate(), f"no {what}: {self.events}; {self.stderr()}"

    def at_step(self, job: str, step: int) -> bool:
        return any(isinstance(e, Progress) and e.step >= step for e in self.events.get(job, []))

    def last(self, job: str):
        """The job's last event (Finished, Failed or Requeue), waited for."""
        ended = lambda: any(isinstance(e, (Finished, Failed, Requeue)) for e in self.events.get(job, []))  # noqa: E731
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


def test_a_step_out_of_memory_hands_the_largest_job_back_with_its_checkpoint_and_the_rest_go_on(tiny_model, tmp_path):
    """The group's shared step runs out of memory (injected past a token budget) once a small job joins a huge one:
    nobody fails; the huge one, having taken the most of the step, leaves with a checkpoint of where it stood and is
    handed back (Requeue, naming only itself); the small one trains to its end on the loss curve it has alone."""
    from tests.test_co_train import data_rows
    from trainer.co_train.group import OOM_FAULT_ENV

    huge = spec(tiny_model, tmp_path, "huge", batch_size=64, max_steps=8)
    huge = msgspec.structs.replace(huge, request=msgspec.structs.replace(huge.request, data=data_rows(6)))
    small = spec(tiny_model, tmp_path, "small", max_steps=5)
    group = GroupProcess(env={OOM_FAULT_ENV: "1000"})  # the small job's steps hold at most 128 positions
    try:
        group.send("add", "huge", huge)
        group.wait("two steps of the huge job, alone in the group", lambda: group.at_step("huge", 2))
        group.send("add", "small", small)
        handed_back = group.last("huge")
        assert group.proc.stdin is not None
        group.proc.stdin.close()
        done = group.last("small")
        assert group.proc.wait(timeout=DEADLINE_S) == 0
    finally:
        group.proc.kill()
    assert isinstance(handed_back, Requeue), handed_back
    assert handed_back.step >= 2 and "ran out of memory" in handed_back.message and "small" not in handed_back.message
    assert handed_back.checkpoint == str(Path(huge.out_dir) / "checkpoints" / f"step-{handed_back.step}")
    assert (Path(handed_back.checkpoint) / "trainer_state.pt").is_file()
    assert f"from step {handed_back.step}" in handed_back.message
    assert isinstance(done, Finished) and done.state == "trained" and done.step == 5, done
    curve = [e.loss for e in group.events["small"] if isinstance(e, Progress)]
    assert curve == pytest.approx(alone_curve(tiny_model, small), abs=1e-5, rel=0)


def alone_curve(tiny_model, job_spec) -> list[float]:
    """The job's per-step losses trained alone (a group of one, in this process)."""
    from trainer.co_train.group import CoTrainer
    from trainer.model import load

    tokenizer, model = load(str(tiny_model), "cpu", torch.float32)
    group = CoTrainer(model, tokenizer)
    job = group.add_job(job_spec)
    group.run()
    return [r.loss for r in job.history]


def test_a_superseded_attempts_lines_and_events_never_pass_for_the_next_one(tiny_model, tmp_path):
    """Attempt 2 of a job joins while attempt 1 still trains in the group (the job was placed again before its
    last step ended): attempt 1 leaves at once, a line still meant for it is left, and every event of the job from
    then on is attempt 2's, each tagged so."""
    first = msgspec.structs.replace(spec(tiny_model, tmp_path, "a1", max_steps=200), job="a", attempt=1)
    second = msgspec.structs.replace(spec(tiny_model, tmp_path, "a2", max_steps=3), job="a", attempt=2)
    group = GroupProcess()
    try:
        group.send("add", "a", first)
        group.wait("attempt 1 under way", lambda: group.at_step("a", 1))
        group.send("add", "a", second)
        group.send("stop", "a", attempt=1)  # meant for the attempt that is gone: left
        group.send("add", "a", first)  # attempt 1's line again, late: the group holds the newer
        assert group.proc.stdin is not None
        group.proc.stdin.close()
        done = group.last("a")
        assert group.proc.wait(timeout=DEADLINE_S) == 0
        stderr = group.stderr()
    finally:
        group.proc.kill()
    assert isinstance(done, Finished) and done.state == "trained" and done.step == 3, done
    assert Path(done.adapter_dir).is_relative_to(Path(second.out_dir))
    assert group.attempts[("a", 2)][-1] is done
    assert [e.step for e in group.attempts[("a", 2)] if isinstance(e, Progress)] == [1, 2, 3]
    assert not any(isinstance(e, (Finished, Failed)) for e in group.attempts[("a", 1)])
    assert "attempt 1 leaves the group, superseded by attempt 2" in stderr and "stop for job a attempt 1 left" in stderr
