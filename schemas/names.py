"""Every NATS subject, stream, consumer, KV bucket and object-store bucket jetlora uses.

The subject tree is shaped so that permissions can be written against it:

    jetlora.api.<verb>                  requests from submitters and operators
    jetlora.api.pinning                 artifact service -> scheduler: which unfinished jobs name a dataset
    jetlora.node.<node>.heartbeat       an agent's heartbeat (core NATS)
    jetlora.node.<node>.assign          scheduler -> agent: run this job (request/reply)
    jetlora.node.<node>.control         scheduler -> agent: cancel / stop-and-save / pause a job
    jetlora.node.<node>.reclaim         an engine -> agent: give this device's memory back (pauses its job)
    jetlora.node.<node>.session         gateway -> agent: a call for a training session there (the Tinker API)
    jetlora.node.<node>.evaluate        evals service -> agent: an eval run's items through an engine there
    jetlora.job.<tenant>.<job>.<node>.state      agent -> JOBS stream: the job's state changed (on that node)
    jetlora.job.<tenant>.<job>.<node>.progress   agent -> JOBS stream: a training event (on that node)
    jetlora.job.<tenant>.<job>.<node>.preparing  agent -> JOBS stream: tokenizing the data, before the first step
    jetlora.job.<tenant>.<job>.<node>.samples    agent -> JOBS stream: the adapter's answers to the sample prompts
                                        (<tenant>: the job's, `_` for an admin's: a tenant reads jetlora.job.<t>.>)
    jetlora.artifacts.upload.<node>.<job>  agent -> artifact service: one chunk (request/reply)
    jetlora.artifacts.<verb>            operators' artifact requests
    jetlora.datasets.upload.<name>      a client -> artifact service: one chunk of a dataset (request/reply)
    jetlora.datasets.<verb>             list, show and delete datasets
    jetlora.adapters.<verb>             the adapter registry: register, list, show, promote, rollback, retire,
                                        references
    jetlora.adapters.status.<node>      agent -> anyone: what its engines did with an adapter
    jetlora.evals[.<tenant>].<verb>     the evals service: evals, their runs and results

No other module spells a subject: they all call these functions.
"""

from __future__ import annotations

import re
from typing import NamedTuple

PREFIX = "jetlora"

# JetStream resources
JOBS_STREAM = "JETLORA_JOBS"  # state and progress events of every job, replayable
JOBS_KV = "jetlora_jobs"  # one record per job: the scheduler's durable queue
LEASE_KV = "jetlora_lease"  # the active scheduler's lease
TRAINER_LEASES_KV = "jetlora_trainer_leases"  # which attempt of each job may compute (schemas/trainer_lease.py)
IDEMPOTENCY_KV = "jetlora_idempotency"  # submission keys, each kept for the idempotency window (the bucket's max age)
JOB_INDEX_STREAM = "JETLORA_JOB_INDEX"  # jobs in submission and in finishing order, for listing and retention
ARTIFACTS_BUCKET = "jetlora_artifacts"  # object store of adapters and GGUF files
DATASETS_BUCKET = "jetlora_datasets"  # object store of training data, one object per dataset name
ADAPTERS_KV = "jetlora_adapters"  # the adapter registry: version.<name>.<n>, alias.<name>, node.<name>.<node>
KEYS_KV, GATEWAY_JOBS_KV = "jetlora_keys", "jetlora_gateway_jobs"  # the OpenAI gateway's keys, and its jobs' requests
EVALS_KV = "jetlora_evals"  # evals and their runs (schemas/evals.py): eval.<tenant>.<name>, run.<tenant>.<id>
TINKER_KV = "jetlora_tinker"  # the Tinker API's sessions, models and samplers (schemas/tinker_store.py)
TINKER_FUTURES_KV = "jetlora_tinker_futures"  # its calls and their outcomes, each kept a day at most
TINKER_RESULTS_BUCKET = "jetlora_tinker_results"  # object store: outcomes (and calls) too large for a KV value
TENANTS_KV = "jetlora_tenants"  # each tenant's quota, weight and borrowing limit (schemas/tenants.py): tenant.<name>
SCHEDULER_CONSUMER = "jetlora_scheduler_states_v3"  # durable consumer of job states (v3: the tenant in the subject)
OLD_SCHEDULER_CONSUMERS = ("jetlora_scheduler_states_v2",)  # filters that match no subject now: deleted at start

SCHEDULER_SERVICE = "jetlora-scheduler"  # nats.micro names ($SRV.PING etc.)
ARTIFACT_SERVICE = "jetlora-artifacts"
AGENT_SERVICE = "jetlora-agent"  # one instance per node, its endpoints under node_group(node)

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_token(value: str, what: str) -> str:
    """A node or job id must be one subject token: letters, digits, '_' and '-'."""
    if not _TOKEN.match(value or ""):
        raise ValueError(
            f"{what} {value!r} must be 1-128 letters, digits, '_' or '-' (it becomes a NATS subject token)"
        )
    return value


def _subjects(kind, base: str):
    """A NamedTuple of subjects: each field's name is the last token under `base`."""
    return kind(*(f"{base}.{last}" for last in kind._fields))


# requests served by the scheduler (nats.micro group "jetlora.api")
API_GROUP = f"{PREFIX}.api"


class JobsApi(NamedTuple):
    """Requests about jobs: an admin's (jetlora.api.<verb>, every job) or a tenant's (jetlora.api.<tenant>.<verb>,
    its own jobs only)."""

    submit: str
    job: str
    jobs: str
    cancel: str
    stop: str
    pause: str  # checkpoint and free the device; the job keeps its place in the records
    resume: str  # a paused job goes back to the queue, to go on from its checkpoint
    events: str  # a job's events, a page at a time, from the JOBS stream
    checkpoints: str  # a job's checkpoints with their losses
    why: str  # why a queued job waits, node by node
    tenants: str  # each tenant's weight, nominal, borrowed devices, fair share and devices in use


def jobs_api(tenant: str | None = None) -> JobsApi:
    return _subjects(JobsApi, API_GROUP if tenant is None else f"{API_GROUP}.{tenant}")


_ADMIN = jobs_api()
SUBMIT, GET_JOB, LIST_JOBS, CANCEL, STOP = _ADMIN.submit, _ADMIN.job, _ADMIN.jobs, _ADMIN.cancel, _ADMIN.stop
PAUSE, RESUME, EVENTS, CHECKPOINTS = _ADMIN.pause, _ADMIN.resume, _ADMIN.events, _ADMIN.checkpoints
WHY, TENANTS = _ADMIN.why, _ADMIN.tenants
LIST_NODES = f"{API_GROUP}.nodes"
DATASET_PINNING = f"{API_GROUP}.pinning"  # the artifact service asks the scheduler which unfinished jobs name a dataset
ADMIN_TENANT = "_"  # the tenant token of an admin's job in its event subjects
RESERVED_TENANTS = {"upload", ADMIN_TENANT}  # jetlora.artifacts.upload.* carries chunks


def check_tenant(value: str) -> str:
    check_token(value, "tenant")
    if value in RESERVED_TENANTS:
        raise ValueError(
            f"tenant {value!r} is reserved (it would share subjects with jetlora's own: {', '.join(sorted(RESERVED_TENANTS))}); choose another"
        )
    return value


# requests served by the artifact service (nats.micro group "jetlora.artifacts")
ARTIFACTS_GROUP = f"{PREFIX}.artifacts"
ARTIFACTS_UPLOAD_ALL = f"{ARTIFACTS_GROUP}.upload.*.*"


class ArtifactsApi(NamedTuple):
    """Artifact requests: an admin's (every artifact) or a tenant's (those of its own jobs)."""

    list: str
    delete: str


def artifacts_api(tenant: str | None = None) -> ArtifactsApi:
    return _subjects(ArtifactsApi, ARTIFACTS_GROUP if tenant is None else f"{ARTIFACTS_GROUP}.{tenant}")


ARTIFACTS_LIST, ARTIFACTS_DELETE = artifacts_api()


def artifact_upload(node_id: str, job: str) -> str:
    """Where a node sends the chunks of a job's artifact: the node is in the subject, so permissions let an agent
    upload only as itself, and the artifact service checks that it holds the job's current attempt."""
    return f"{ARTIFACTS_GROUP}.upload.{node_id}.{job}"


# datasets, also served by the artifact service (nats.micro group "jetlora.datasets")
DATASETS_GROUP = f"{PREFIX}.datasets"
DATASETS_UPLOAD_ALL = f"{DATASETS_GROUP}.upload.*"


class DatasetsApi(NamedTuple):
    """Dataset requests: list them, show one (its stats and first rows), delete one."""

    list: str
    show: str
    delete: str


def datasets_api(tenant: str | None = None) -> DatasetsApi:
    """An admin's dataset requests (jetlora.datasets.<verb>: every dataset), or a tenant's
    (jetlora.datasets.<tenant>.<verb>: its own, and those an admin shared with it)."""
    return _subjects(DatasetsApi, DATASETS_GROUP if tenant is None else f"{DATASETS_GROUP}.{tenant}")


DATASETS = datasets_api()
TENANT_DATASETS_UPLOAD_ALL = f"{DATASETS_GROUP}.*.upload.*"


def dataset_upload(name: str, tenant: str | None = None) -> str:
    """An admin's upload (jetlora.datasets.upload.<name>) or a tenant's (jetlora.datasets.<tenant>.upload.<name>)."""
    return f"{DATASETS_GROUP}.upload.{name}" if tenant is None else f"{DATASETS_GROUP}.{tenant}.upload.{name}"


EVALS_GROUP = f"{PREFIX}.evals"  # the evals service (nats.micro group "jetlora.evals", served beside the registry)
EVALS_SERVICE = "jetlora-evals"


class EvalsApi(NamedTuple):
    """Eval requests: an admin's (jetlora.evals.<verb>) or a tenant's (jetlora.evals.<tenant>.<verb>, its own)."""

    create: str
    list: str
    show: str
    delete: str
    run: str  # place a run of an eval against a base model or an adapter version
    runs: str
    run_show: str
    run_cancel: str
    run_delete: str
    items: str  # a run's per-item results, a page at a time
    compare: str  # two completed runs of one eval, paired by item (schemas/gates.py)


def evals_api(tenant: str | None = None) -> EvalsApi:
    return _subjects(EvalsApi, EVALS_GROUP if tenant is None else f"{EVALS_GROUP}.{tenant}")


TENANT_GROUPS = (API_GROUP, ARTIFACTS_GROUP, DATASETS_GROUP, EVALS_GROUP)  # the requests that carry a tenant token


def reserved_tenant_subjects() -> list[str]:
    """Every subject a request under a reserved tenant token takes (jetlora.api._.jobs, jetlora.datasets.upload.…):
    what a user who acts for tenants (the gateway, a tenant) is denied, whatever its wildcards allow."""
    return [f"{group}.{token}.>" for group in TENANT_GROUPS for token in sorted(RESERVED_TENANTS)]


def dataset_object(name: str, owner: str | None = None) -> str:
    """The object-store name of a dataset: a tenant's live under its own prefix, an admin's under the bare name."""
    return name if owner is None else f"{owner}/{name}"


# the adapter registry (nats.micro group "jetlora.adapters", served beside the scheduler)
ADAPTERS_GROUP = f"{PREFIX}.adapters"
ADAPTER_SERVICE = "jetlora-adapters"


class AdaptersApi(NamedTuple):
    register: str
    list: str
    show: str
    promote: str
    rollback: str
    retire: str
    references: str  # which of some jobs' artifacts registered versions reference (the scheduler's retention asks)


ADAPTERS = _subjects(AdaptersApi, ADAPTERS_GROUP)


def adapter_status(node_id: str = "*") -> str:
    return f"{ADAPTERS_GROUP}.status.{node_id}"


def adapter_version_key(name: str, version: int | str) -> str:
    return f"version.{name}.{version}"


def adapter_alias_key(name: str = "*") -> str:
    return f"alias.{name}"


def adapter_node_key(name: str, node_id: str) -> str:
    return f"node.{name}.{node_id}"


class NodeSubjects(NamedTuple):
    """One node's subjects (every node's, with the wildcard)."""

    heartbeat: str  # agent -> scheduler and dashboards: alive, and each device's free memory (core NATS)
    assign: str  # scheduler -> agent: run this job on that device (request/reply)
    control: str  # scheduler -> agent: cancel, stop-and-save or pause a job (request/reply)
    reclaim: str  # a serving engine (or its operator) -> agent: this device's memory is wanted back (request/reply)
    session: str  # gateway -> agent: a call for a training session the node runs (schemas/sessions.py, request/reply)
    evaluate: str  # evals service -> agent: an eval run through its engine (schemas/engine_evals.py, request/reply)


def node(node_id: str = "*") -> NodeSubjects:
    return _subjects(NodeSubjects, node_group(node_id))


def node_group(node_id: str) -> str:
    """What a node's subjects start with: its agent's nats.micro group (AGENT_SERVICE)."""
    return f"{PREFIX}.node.{node_id}"


class JobSubjects(NamedTuple):
    """One job's events as one node reports them, in the JOBS stream. The node is in the subject so that an
    agent's permissions let it speak only for itself, and the scheduler hears whom an event is from."""

    state: str  # the job changed state
    progress: str  # a training step's figures
    preparing: str  # how far the data's preparation is, before the first step
    samples: str  # what the adapter (and the base model) answer to the sample prompts


def tenant_token(tenant: str | None) -> str:
    return ADMIN_TENANT if tenant is None else tenant


def job(job_id: str = "*", node_id: str = "*", tenant: str = "*") -> JobSubjects:
    """tenant: tenant_token(the job's tenant) to publish; "*" to read whoever's it is."""
    return _subjects(JobSubjects, f"{PREFIX}.job.{tenant}.{job_id}.{node_id}")


def job_events(job_id: str, tenant: str = "*") -> str:
    """Every event of one job, from every node it ran on: what a dashboard subscribes to."""
    return f"{PREFIX}.job.{tenant}.{job_id}.>"


def tenant_events(tenant: str) -> str:
    """Every event of every job of one tenant: what that tenant's users may subscribe to."""
    return f"{PREFIX}.job.{tenant}.>"


HEARTBEATS_ALL = node().heartbeat
JOB_STATES_ALL = job().state
JOB_PROGRESS_ALL = job().progress
JOBS_STREAM_SUBJECTS = [f"{PREFIX}.job.>"]
JOB_INDEX_SUBJECTS = [f"{PREFIX}.jobindex.>"]


def job_index_submitted(tenant: str = "*") -> str:
    """One entry per job, in submission order, under its tenant's token ("*": every tenant's)."""
    return f"{PREFIX}.jobindex.all.{tenant}"


def job_index_finished(tenant: str = "*", state: str = "*") -> str:
    """One entry per finished job, in finishing order, under its tenant's token and final state."""
    return f"{PREFIX}.jobindex.done.{tenant}.{state}"


def artifact_name(job: str, kind: str, step: int | None = None) -> str:
    """The object-store name of one artifact of a job (checkpoints: one per step)."""
    return f"{job}/{kind}" if step is None else f"{job}/{kind}-{step}"


def sampler_save_object(job: str, save: str) -> str:
    """The object-store name of a Tinker session's named sampler save (one object per name, kept until deleted)."""
    return f"{job}/sampler-{save}"
