"""Every metric of a run in a TensorBoard event file, so `tensorboard --logdir` works on a downloaded job."""

from __future__ import annotations

import shutil
from pathlib import Path

from trainer.job.metrics import progress_metrics


class TensorBoardLog:
    """A resumed run carries on the log its checkpoint holds: TensorBoard reads every event file of the directory,
    so the steps before the pause and after it make one curve."""

    def __init__(self, log_dir: Path, carried_from: Path | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (the train extra)

        self.dir = log_dir
        if carried_from is not None and (carried_from / "tensorboard").is_dir():
            shutil.copytree(carried_from / "tensorboard", log_dir, dirs_exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def copy_into(self, checkpoint: Path) -> None:
        """The log so far goes with a checkpoint, for the run that resumes from it."""
        self.writer.flush()
        shutil.copytree(self.dir, checkpoint / "tensorboard", dirs_exist_ok=True)

    def progress(self, p) -> None:
        for name, value in progress_metrics(p).items():
            self.writer.add_scalar(name, value, p.step)

    def evaluation(self, step: int, value: float, metric: str = "loss") -> None:
        """At the step it was computed (progress events repeat the latest): eval/loss, or grpo's eval/reward."""
        self.writer.add_scalar(f"eval/{metric}", value, step)

    def samples(self, ev) -> None:
        text = "\n\n".join(f"**{s.prompt}**\n\n{s.answer}" for s in ev.samples)
        self.writer.add_text(f"samples/{ev.model}", text, ev.step)

    def close(self) -> Path:
        self.writer.close()
        return self.dir


class NoLog:
    """What ranks other than 0 of a multi-device job keep instead: rank 0 logs the run."""

    def copy_into(self, checkpoint: Path) -> None: ...
    def progress(self, p) -> None: ...
    def evaluation(self, step: int, value: float, metric: str = "loss") -> None: ...
    def samples(self, ev) -> None: ...
    def close(self) -> None: ...
