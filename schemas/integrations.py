"""Where else a job's metrics go (the shape of OpenAI's fine-tuning `integrations`): W&B and MLflow. Credentials
are the node's own (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ... in the agent's environment), never the job's."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct, field

from schemas.text import OneLine

MLFLOW_JOB_TAG = "jetlora.job"  # the MLflow run tag that names its job
Tag = Annotated[OneLine, Meta(min_length=1, max_length=64)]


class WandbIntegration(Struct, forbid_unknown_fields=True, kw_only=True, tag="wandb", tag_field="type"):
    """A W&B run per job attempt: every step's metrics, the samples, the job's id and config. With WANDB_MODE=offline
    on the node it is written under the job's directory and nothing leaves the node."""

    project: Annotated[OneLine, Meta(min_length=1, max_length=128)]
    name: Annotated[OneLine, Meta(max_length=128, description="the run's name; default: the job's label or id")] = ""
    tags: Annotated[list[Tag], Meta(max_length=32)] = field(default_factory=list)


class MlflowIntegration(Struct, forbid_unknown_fields=True, kw_only=True, tag="mlflow", tag_field="type"):
    """An MLflow run per job attempt. A `file:` tracking URI keeps everything on the node."""

    tracking_uri: Annotated[
        OneLine, Meta(max_length=1024, description=("where the runs go; default: the node's MLFLOW_TRACKING_URI"))
    ] = ""
    experiment: Annotated[OneLine, Meta(min_length=1, max_length=256)] = "jetlora"


Integration = WandbIntegration | MlflowIntegration
