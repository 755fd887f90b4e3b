"""A job's W&B and MLflow runs: the metrics and samples the trainer publishes, with the job's id and config.

Credentials and modes are the node's (WANDB_API_KEY, WANDB_MODE=offline, MLFLOW_TRACKING_URI, ...): the trainer
inherits the agent's environment, and a job cannot name any. A tracker that fails while training is dropped with a
warning; the run goes on, its metrics still in the job's events and TensorBoard."""

from __future__ import annotations

import os
import sys
import time

import msgspec

from schemas.integrations import MLFLOW_JOB_TAG
from trainer.errors import JobError
from trainer.job.metrics import progress_metrics

EXTRA = "pip install 'jetlora[tracking]' on the node, or drop it from the job's integrations"


def run_config(spec) -> dict:
    """What the run records of the job: its id, attempt and hyperparameters (never its data)."""
    req = spec.request
    return {
        "job": spec.job,
        "model": req.model,
        "lora": msgspec.to_builtins(req.lora),
        "train": msgspec.to_builtins(req.train),
        "quantization": req.quantization,
        "devices": req.devices,
    }


class WandbRun:
    def __init__(self, spec, integration, out_dir) -> None:
        try:
            import wandb
        except ImportError:
            raise JobError(f"integrations: the wandb package is not on this node; {EXTRA}") from None
        self.wandb = wandb
        self.run = wandb.init(
            project=integration.project,
            name=integration.name or spec.request.label or spec.job,
            tags=list(integration.tags),
            config=run_config(spec),
            job_type="jetlora-sft",
            dir=None if os.environ.get("WANDB_DIR") else str(out_dir),
            reinit="create_new",
        )

    def progress(self, p) -> None:
        self.run.log(progress_metrics(p), step=p.step)

    def evaluation(self, step: int, value: float, metric: str = "loss") -> None:
        self.run.log({f"eval/{metric}": value}, step=step)

    def samples(self, ev) -> None:
        table = self.wandb.Table(columns=["prompt", "answer"], data=[[s.prompt, s.answer] for s in ev.samples])
        self.run.log({f"samples/{ev.model}": table}, step=ev.step)

    def close(self) -> None:
        self.run.finish()


class MlflowRun:
    def __init__(self, spec, integration, out_dir) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise JobError(f"integrations: the mlflow package is not on this node; {EXTRA}") from None
        self.client = MlflowClient(tracking_uri=integration.tracking_uri or None)
        found = self.client.get_experiment_by_name(integration.experiment)
        experiment = found.experiment_id if found else self.client.create_experiment(integration.experiment)
        self.run_id = self.client.create_run(
            experiment, run_name=spec.request.label or spec.job, tags={MLFLOW_JOB_TAG: spec.job}
        ).info.run_id
        flat = {f"{group}.{k}": v for group in ("lora", "train") for k, v in run_config(spec)[group].items()}
        for key, value in {**flat, "model": spec.request.model}.items():
            self.client.log_param(self.run_id, key, str(value)[:500])

    def _log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def progress(self, p) -> None:
        self._log(progress_metrics(p), p.step)

    def evaluation(self, step: int, value: float, metric: str = "loss") -> None:
        self._log({f"eval/{metric}": value}, step)

    def samples(self, ev) -> None:
        text = "\n\n".join(f"**{s.prompt}**\n\n{s.answer}" for s in ev.samples)
        self.client.log_text(self.run_id, text, f"samples/step-{ev.step:07d}-{ev.model}.md")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


KINDS = {"wandb": WandbRun, "mlflow": MlflowRun}


class RunLogs:
    """TensorBoard and the job's trackers, fed as one: what TensorBoardLog is fed."""

    def __init__(self, board, spec, out_dir) -> None:
        self.board = board
        self.trackers: list = []
        for i, integration in enumerate(spec.request.integrations):
            kind = type(integration).__struct_config__.tag
            try:
                self.trackers.append(KINDS[kind](spec, integration, out_dir))
            except JobError:
                raise
            except Exception as e:
                raise JobError(f"integrations[{i}] ({kind}) could not start a run: {type(e).__name__}: {e}") from e

    def copy_into(self, checkpoint) -> None:
        self.board.copy_into(checkpoint)

    def _each(self, method: str, *args) -> None:
        getattr(self.board, method)(*args)
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:
                print(
                    f"jetlora: {type(tracker).__name__} stopped logging ({type(e).__name__}: {e}); the run goes "
                    "on, its metrics are in the job's events and TensorBoard",
                    file=sys.stderr,
                )
                self.trackers.remove(tracker)

    def progress(self, p) -> None:
        self._each("progress", p)

    def evaluation(self, step: int, value: float, metric: str = "loss") -> None:
        self._each("evaluation", step, value, metric)

    def samples(self, ev) -> None:
        self._each("samples", ev)

    def close(self) -> None:
        self._each("close")
