"""Evals: a dataset of items (rft rows: messages ending in a user turn, plus the fields graders read), graders
(OpenAI's testing_criteria) and sampling settings; runs of one against a base model or a registered adapter version.
A run is placed as a job (train.method "eval", its `evaluate` part below): the trainer samples each item's
completions, grades them with every grader and stores the results as the job's `eval` artifact, one JSON line an
item then the summary (`ItemResult`..., `EvalSummary`); or, where an engine serves the version under its name, it
runs through that engine (schemas/engine_evals.py) and is stored in the same format; a run of samples made
elsewhere (`samples`: OpenAI's `jsonl` data source) is graded by the evals service as sent, stored the same way. The
evals service keeps evals and runs in names.EVALS_KV (the end of this module); a run's record holds its summary once
it ended: results are kept per adapter version.

This module imports no other schema module but graders, so that schemas/jobs.py may take `EvalJob`."""

from __future__ import annotations

import math
import random
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from schemas.graders import Grader, Sample

Token = Annotated[
    str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$", description="1-128 letters, digits, '_' or '-' (a subject token)")
]
RESAMPLES, SEED = 1000, 0  # the bootstrap's: fixed, so a run's interval is reproducible
SAMPLES = "samples"  # EvalRun.via of a run of samples made elsewhere (OpenAI's `jsonl` source): nothing sampled
SAMPLES_MAX = 10_000  # the rows of such a run
DEFAULT_PASS = 0.5  # a criterion with no pass_threshold passes a sample scoring at least this (string_check: a match)


class Sampling(Struct, forbid_unknown_fields=True, kw_only=True):
    """How each item's completions are sampled."""

    temperature: Annotated[float, Meta(ge=0, le=10, description="0: greedy")] = 0.0
    max_tokens: Annotated[int, Meta(ge=1, le=32768)] = 64
    n: Annotated[int, Meta(ge=1, le=64, description="completions per item, each graded")] = 1
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] = 0


class Criterion(Struct, forbid_unknown_fields=True, kw_only=True):
    """A grader (OpenAI's grader JSON) and the score at which a sample passes it."""

    grader: Grader
    pass_threshold: float | None = None

    def threshold(self) -> float:
        return DEFAULT_PASS if self.pass_threshold is None else self.pass_threshold


class EvalJob(Struct, forbid_unknown_fields=True, kw_only=True):
    """A job's `evaluate`: what its trainer (train.method "eval") grades, and how it samples."""

    eval: Token
    run: Token
    criteria: Annotated[list[Criterion], Meta(min_length=1, max_length=16)]
    sampling: Sampling = field(default_factory=Sampling)


# --- what a run stores: the `eval` artifact's lines --------------------------------------------------------------
class ItemResult(Struct, tag="item", tag_field="type", kw_only=True):
    """One item: its row, the messages sampled from, each completion, each grader's score of each completion."""

    index: int
    item: dict[str, Any]
    input: list[dict[str, str]]
    outputs: list[str]
    scores: dict[str, list[float]]
    errors: dict[str, list[str]] = field(default_factory=dict)  # a grader's failures (scored 0), per completion
    passed: dict[str, list[bool]] = field(default_factory=dict)


class GraderSummary(Struct, kw_only=True):
    """One grader over the run: the mean of the items' scores, its 95% bootstrap interval, the share that passed."""

    name: str
    mean: float
    low: float
    high: float
    pass_rate: float
    passed: int  # samples
    failed: int
    errored: int


class EvalSummary(Struct, tag="summary", tag_field="type", kw_only=True):
    items: int
    samples: int
    graders: list[GraderSummary]
    errored: int = 0  # items any grader failed on
    passed: int = 0  # items whose every sample passed every grader
    resamples: int = RESAMPLES
    seed: int = SEED


ResultLine = ItemResult | EvalSummary


def bootstrap(values: list[float], resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the mean of `values` (resampled with replacement)."""
    if not values:
        return math.nan, math.nan
    rng, n = random.Random(seed), len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


def summarize(results: list[ItemResult], criteria: list[Criterion]) -> EvalSummary:
    graders = []
    for c in criteria:
        name = c.grader.name
        per_item = [sum(r.scores[name]) / len(r.scores[name]) for r in results if r.scores.get(name)]
        flags = [p for r in results for p in r.passed.get(name, [])]
        errored = sum(1 for r in results for e in r.errors.get(name, []) if e)
        mean = sum(per_item) / len(per_item) if per_item else math.nan
        low, high = bootstrap(per_item)
        rate = sum(flags) / len(flags) if flags else 0.0
        graders.append(
            GraderSummary(
                name=name,
                mean=mean,
                low=low,
                high=high,
                pass_rate=rate,
                passed=sum(flags),
                failed=len(flags) - sum(flags),
                errored=errored,
            )
        )
    return EvalSummary(
        items=len(results),
        samples=sum(len(r.outputs) for r in results),
        graders=graders,
        errored=sum(1 for r in results if any(e for es in r.errors.values() for e in es)),
        passed=sum(1 for r in results if all(all(p) for p in r.passed.values())),
    )


# --- the evals service's records and requests ----------------------------------------------------------------------
RunState = Literal["queued", "in_progress", "completed", "failed", "canceled"]
Via = Literal["auto", "engine", "trainer"]  # what samples a run: auto, an engine that serves the name where one does


class EvalDef(Struct, kw_only=True):
    """An eval as stored: `eval.<tenant>.<name>`."""

    name: Token
    tenant: str | None = None
    dataset: str | None = None  # the items (an rft dataset of the tenant's); None: each run names its own
    criteria: list[Criterion]
    sampling: Sampling = field(default_factory=Sampling)
    title: str = ""
    item_schema: dict[str, Any] | None = None  # OpenAI's data_source_config.item_schema, as sent
    include_sample_schema: bool = False  # OpenAI's data_source_config.include_sample_schema, as sent
    metadata: dict[str, str] | None = None
    created: float = 0.0
    updated: float = 0.0


class EvalRun(Struct, kw_only=True):
    """A run as stored: `run.<tenant>.<id>`. adapter/version: the registered version it graded (None: the base)."""

    id: Token
    eval: Token
    tenant: str | None = None
    job: str
    base_model: str
    adapter: str | None = None
    version: int | None = None
    dataset: str
    state: RunState = "queued"
    message: str = ""
    created: float = 0.0
    updated: float = 0.0
    summary: EvalSummary | None = None
    results: str | None = None  # the object-store name of its `eval` artifact
    sha256: str | None = None
    name: str = ""
    metadata: dict[str, str] | None = None
    source: dict[str, Any] | None = None  # OpenAI's data_source, as sent (the gateway's runs)
    sampling: Sampling | None = None  # what it sampled with, where the run said (else the eval's)
    via: str = "trainer"  # what sampled it: "trainer", "engine <label> on <node>" (schemas/engine_evals.py), SAMPLES
    via_note: str = ""  # why that path: what forced it, or why no engine did (a fallback's failure)

    @property
    def model(self) -> str:
        return self.base_model if self.adapter is None else f"{self.adapter}@{self.version}"


class EvalCreate(Struct, forbid_unknown_fields=True, kw_only=True):
    name: Token
    dataset: Token | None = None
    criteria: Annotated[list[Criterion], Meta(min_length=1, max_length=16)]
    sampling: Sampling = field(default_factory=Sampling)
    title: Annotated[str, Meta(max_length=512)] = ""
    item_schema: dict[str, Any] | None = None
    include_sample_schema: bool = False
    metadata: dict[str, str] | None = None
    replace: bool = False  # an update: the eval must exist (its runs stay)


class EvalQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    name: Token


class EvalListQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class EvalReply(Struct, tag="eval", tag_field="type", kw_only=True):
    eval: EvalDef


class EvalList(Struct, tag="evals", tag_field="type", kw_only=True):
    evals: list[EvalDef]


class SampledItem(Struct, forbid_unknown_fields=True, kw_only=True):
    """A row of samples made elsewhere (OpenAI's `jsonl` data source): the item, and the sample its graders grade."""

    item: dict[str, Any]
    sample: Sample


class RunRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Run an eval against a registered adapter version (adapter, version: none = what it serves now) or a base
    model (base_model), on a node that has base_dir; or grade `samples` made elsewhere as they are (no model, no
    base_dir: ""), in the evals service, nothing sampled (EvalRun.via SAMPLES)."""

    eval: Token
    adapter: Token | None = None
    version: Annotated[int, Meta(ge=1)] | None = None
    base_model: str | None = None
    base_dir: str
    accelerator: Literal["gpu", "cpu", "any"] = "gpu"
    dataset: Token | None = None  # the items, instead of the eval's own dataset
    name: Annotated[str, Meta(max_length=256)] = ""
    metadata: dict[str, str] | None = None
    source: dict[str, Any] | None = None
    sampling: Sampling | None = None  # instead of the eval's
    via: Via = "auto"  # auto: through an engine that serves adapter@version now, else the trainer
    samples: Annotated[list[SampledItem], Meta(min_length=1, max_length=SAMPLES_MAX)] | None = None


class RunQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    run: Token


class RunListQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    eval: Token | None = None
    adapter: Token | None = None


class RunReply(Struct, tag="run", tag_field="type", kw_only=True):
    run: EvalRun


class RunList(Struct, tag="runs", tag_field="type", kw_only=True):
    runs: list[EvalRun]


class ItemsQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    run: Token
    after: Annotated[int, Meta(ge=-1)] = -1  # the index of the last item of the page before
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100


class ItemsPage(Struct, tag="items", tag_field="type", kw_only=True):
    items: list[ItemResult]
    has_more: bool = False
    via: str = ""  # the run's (EvalRun.via)


# --- the bucket (names.EVALS_KV) as stored: `eval.<tenant>.<name>` (EvalDef), `run.<tenant>.<id>` (EvalRun), the
# tenant token `_` for an admin's; values are JSON ----------------------------------------------------------------
ADMIN = "_"
DECODERS: dict[str, msgspec.json.Decoder] = {
    "eval": msgspec.json.Decoder(EvalDef),
    "run": msgspec.json.Decoder(EvalRun),
}
RESULT_LINE = msgspec.json.Decoder(ResultLine)


def eval_key(tenant: str | None, name: str) -> str:
    return f"eval.{tenant or ADMIN}.{name}"


def run_key(tenant: str | None, run: str) -> str:
    return f"run.{tenant or ADMIN}.{run}"
