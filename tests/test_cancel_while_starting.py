"""A cancel that arrives while a job's trainer is being set up or started is never lost: found by the gateway's
pause-resume-cancel test, where a cancel right after a resume sometimes let the trainer run to `succeeded`
(the agent's task was cancelled at an await that swallowed it) or to its end before saying `cancelled`."""

from __future__ import annotations

import time

from schemas.events import Cancelled, TrainerSpec
from services.agent.runner import TrainerRun
from tests.conftest import HOLD_TRAINER, spec_for


def hold_run(tmp_path, tiny_model) -> TrainerRun:
    spec: TrainerSpec = spec_for(tiny_model, tmp_path)
    return TrainerRun(spec, tmp_path / "job", HOLD_TRAINER.split(), {"HOLD_S": "30"})


async def test_a_trainer_cancelled_before_it_starts_is_never_started(tmp_path, tiny_model):
    run = hold_run(tmp_path, tiny_model)
    run.cancel()
    started = time.monotonic()
    assert isinstance(await run.run(lambda ev: None), Cancelled)
    assert run.proc is None and time.monotonic() - started < 5


async def test_a_trainer_cancelled_while_it_starts_is_ended_at_once(tmp_path, tiny_model, monkeypatch):
    run = hold_run(tmp_path, tiny_model)
    start = run._start

    async def cancelled_meanwhile(*args):
        proc = await start(*args)
        run.cancel()  # the signal finds no process yet: what the agent's control handler does in that window
        return proc

    monkeypatch.setattr(run, "_start", cancelled_meanwhile)
    monkeypatch.setattr(run, "_signal", _signal_after_start(run))
    started = time.monotonic()

    async def on_event(ev):
        pass

    assert isinstance(await run.run(on_event), Cancelled)
    assert time.monotonic() - started < 15, "the trainer (30 s) was ended, not waited for"


def _signal_after_start(run):
    """The real signal, except that while the process is being started (proc not yet set) it finds none."""
    real = TrainerRun._signal

    def signal(sig):
        if run.proc is None:
            return
        real(run, sig)

    return signal
