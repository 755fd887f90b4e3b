"""What the agent asks of a running trainer: SIGUSR1, save what was learnt and end as `stopped`; SIGUSR2, save a
checkpoint and end as `paused`. Either ends the run after the step under way. Asked before the trainer started,
they come as JETLORA_STOP / JETLORA_PAUSE in its environment (and the run ends after its first step)."""

from __future__ import annotations

import os
import signal


class Signals:
    def __init__(self) -> None:
        self.pause = bool(os.environ.get("JETLORA_PAUSE"))
        self.asked = self.pause or bool(os.environ.get("JETLORA_STOP"))
        self.agreed_pause = (
            self.pause
        )  # what the ranks last agreed (trainer.job.loop.agree); one rank agrees with itself
        signal.signal(signal.SIGUSR1, self._stop)
        signal.signal(signal.SIGUSR2, self._pause)
        # the agent starts a trainer with both blocked (services/procs.asks_held): one asked meanwhile comes now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGUSR2})

    def _stop(self, *_):
        self.asked = True

    def _pause(self, *_):
        self.asked = self.pause = True
