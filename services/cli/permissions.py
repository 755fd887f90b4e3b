"""Per-role NATS users and their subject permissions, derived from `names` (so they cannot drift from it).

`jetlora permissions --nodes gpu1,gpu2` writes the `authorization` block of a nats-server config.
Passwords are never written: each user's password is `$JETLORA_<USER>_PASSWORD` in nats-server's
environment (nats-server expands `$VAR` in its config), so the repository holds none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from schemas import names, nats_subjects
from schemas.leadership import LEASE_STREAM

JOBS, OBJ = names.JOBS_STREAM, nats_subjects.objects(names.ARTIFACTS_BUCKET).stream
DATA = nats_subjects.objects(names.DATASETS_BUCKET).stream
RESPONSES_PER_REQUEST = 8  # replies one user may send to one request (micro services in one process each answer)
ADAPTERS = nats_subjects.kv(names.ADAPTERS_KV)
TRAINER_LEASES = nats_subjects.kv(names.TRAINER_LEASES_KV)  # any node's agent may take a job's over from another's


def _read_stream(stream: str) -> list[str]:
    """What a client needs to read a stream with an ordered consumer (and info and direct gets)."""
    return [
        nats_subjects.js_api("INFO"),
        nats_subjects.js_api("STREAM", "INFO", stream),
        nats_subjects.js_api("CONSUMER", "CREATE", stream, ">"),
        nats_subjects.js_api("CONSUMER", "CREATE", stream),
        nats_subjects.js_api("CONSUMER", "DELETE", stream, ">"),
        nats_subjects.js_api("CONSUMER", "INFO", stream, ">"),
        nats_subjects.js_api("DIRECT", "GET", stream, ">"),
        nats_subjects.js_api("DIRECT", "GET", stream),
        nats_subjects.js_api("STREAM", "MSG", "GET", stream),
        nats_subjects.js_api("STREAM", "NAMES"),
    ]


def _pulled(stream: str) -> list[str]:
    """What a pull consumer of the stream asks for beyond _read_stream: its next messages. The dashboard's page reads
    the JOBS stream so (nats.js's ordered consumer pulls `$JS.API.CONSUMER.MSG.NEXT.<stream>.<its name>`, where
    nats-py's is pushed); the scheduler's durable consumer stays denied to it (_scheduler_consumer)."""
    return [nats_subjects.js_api("CONSUMER", "MSG", "NEXT", stream, "*")]


def _object_read() -> list[str]:
    return _read_stream(OBJ)


def roles(nodes: list[str], tenants: Sequence[str] = ()) -> dict[str, dict]:
    """Every user's permissions: the services', an admin's, each tenant's and each node agent's."""
    users = _service_users() | _people()
    for tenant in tenants:
        users[f"tenant-{tenant}"] = _tenant(tenant)
    for node in nodes:
        users[f"agent-{node}"] = _agent(node)
    for user, perms in users.items():  # replies come to each user's own inbox, which no other user may read
        perms["subscribe"].append(nats_subjects.inbox_all(user))
        if user != "scheduler":
            perms["deny_publish"] = _scheduler_consumer()
        if user == "gateway" or user.startswith("tenant-"):  # they act for tenants: never under a reserved token
            perms["deny_publish"] += names.reserved_tenant_subjects()
    return users


def _service_users() -> dict[str, dict]:
    scheduler_publishes = [names.node("*").assign, names.node("*").control, nats_subjects.JS_API_ALL]
    scheduler_publishes += [
        nats_subjects.kv(kv).subjects for kv in (names.JOBS_KV, names.LEASE_KV, names.IDEMPOTENCY_KV, names.TENANTS_KV)
    ]  # the tenants bucket: seeded from its --quota flags at its first start
    scheduler_publishes += [ADAPTERS.subjects, nats_subjects.js_acks(JOBS), *names.JOB_INDEX_SUBJECTS]
    scheduler_publishes += [names.ARTIFACTS_DELETE, nats_subjects.SERVICE_DISCOVERY_ALL]
    scheduler_publishes += [names.ADAPTERS.references]  # retention asks the registry what its versions reference
    scheduler_publishes += [names.ADAPTERS.show, names.ADAPTERS.register]  # submit's checks; a job's registration
    # the evals service (beside it): its bucket, and a run's job submitted, shown and cancelled as its tenant's
    scheduler_publishes += [nats_subjects.kv(names.EVALS_KV).subjects, names.SUBMIT, names.CANCEL, names.DATASETS.show]
    scheduler_publishes += [names.jobs_api("*").submit, names.jobs_api("*").cancel, names.datasets_api("*").show]
    scheduler_publishes += [names.EVALS_GROUP + ".>"]  # the registry's gates ask the evals service, as the tenant
    # an eval run through the engine that serves its name: the evals service asks that node, and stores the results
    scheduler_publishes += [names.node("*").evaluate, nats_subjects.objects(names.ARTIFACTS_BUCKET).subjects]
    any_tenant = "*"  # the gateway acts for the tenant of each request's key: a tenant's verbs, never an admin's
    # (roles() denies it the reserved tokens, `_` and `upload`, that this wildcard would match)
    gateway_publishes = list(names.jobs_api(any_tenant)) + list(names.datasets_api(any_tenant))
    gateway_publishes += [names.dataset_upload("*", any_tenant), nats_subjects.kv(names.GATEWAY_JOBS_KV).subjects]
    gateway_publishes += _read_stream(nats_subjects.kv(names.KEYS_KV).stream) + _read_stream(
        nats_subjects.kv(names.GATEWAY_JOBS_KV).stream
    )
    gateway_publishes += [nats_subjects.js_api("STREAM", "INFO", "*"), names.ADAPTERS.show]  # a fine-tuned model's base
    gateway_publishes += [names.ADAPTERS.list, names.ADAPTERS.retire]  # /v1/models: a tenant's, and DELETE (retire)
    gateway_publishes += list(names.evals_api(any_tenant))  # /v1/evals
    gateway_publishes += _read_stream(DATA)  # an eval run's items from a file of the tenant's (it checks whose first)
    gateway_publishes += [names.node("*").session]  # the Tinker API's calls, for sessions of the key's tenant
    gateway_publishes += _tinker_store()  # what the Tinker API's clients were told, shared by every gateway
    gateway_publishes += [names.artifacts_api(any_tenant).delete]  # a Tinker sampler save deleted, as its tenant's
    gateway_publishes += _read_stream(
        nats_subjects.objects(names.ARTIFACTS_BUCKET).stream
    )  # a Tinker export's files, read
    # for the URL its tenant's key signed (services/gateway/tinker/exports.py)
    scheduler_hears = [names.API_GROUP + ".>", names.ADAPTERS_GROUP + ".>", names.EVALS_GROUP + ".>"]
    scheduler_hears += [names.HEARTBEATS_ALL]
    stores = [
        nats_subjects.objects(names.ARTIFACTS_BUCKET).subjects,
        nats_subjects.objects(names.DATASETS_BUCKET).subjects,
    ]
    return {
        "scheduler": {
            "publish": scheduler_publishes,
            "subscribe": scheduler_hears + [names.JOB_PROGRESS_ALL, nats_subjects.SERVICE_DISCOVERY_ALL],
        },
        "artifacts": {
            "publish": stores + [nats_subjects.JS_API_ALL, nats_subjects.SERVICE_DISCOVERY_ALL, names.DATASET_PINNING],
            "subscribe": [
                names.ARTIFACTS_GROUP + ".>",
                names.DATASETS_GROUP + ".>",
                nats_subjects.SERVICE_DISCOVERY_ALL,
            ],
        },
        "gateway": {"publish": gateway_publishes, "subscribe": []},
    }


def _tinker_store() -> list[str]:
    """The Tinker API's buckets: written, followed, and a finished session's records purged."""
    stores = [
        nats_subjects.kv(names.TINKER_KV),
        nats_subjects.kv(names.TINKER_FUTURES_KV),
        nats_subjects.objects(names.TINKER_RESULTS_BUCKET),
    ]
    out = []
    for store in stores:
        out += [store.subjects, nats_subjects.js_api("STREAM", "PURGE", store.stream)] + _read_stream(store.stream)
    return out


def _people() -> dict[str, dict]:
    """Admins' users: who submits, who operates the fleet, and the dashboard."""
    api = list(names.jobs_api()) + [names.LIST_NODES]  # an admin's
    datasets = [names.DATASETS_UPLOAD_ALL, names.DATASETS.list, names.DATASETS.show] + _read_stream(DATA)
    watch = _read_stream(JOBS)
    operates = (
        list(names.ADAPTERS)
        + list(names.evals_api())
        + [names.DATASETS.delete, names.node("*").reclaim, names.ARTIFACTS_LIST]
    )
    operates += [
        names.ARTIFACTS_DELETE,
        nats_subjects.js_api("STREAM", "PURGE", OBJ),
        nats_subjects.objects(names.ARTIFACTS_BUCKET).subjects,
    ]
    operates += [nats_subjects.kv(names.KEYS_KV).subjects] + _read_stream(
        nats_subjects.kv(names.KEYS_KV).stream
    )  # the gateway's keys
    tenants = nats_subjects.kv(names.TENANTS_KV)  # the tenants' quotas: `jetlora tenants set|rm` writes them
    operates += [tenants.subjects] + _read_stream(tenants.stream)
    shown = [names.LIST_JOBS, names.LIST_NODES, names.ARTIFACTS_LIST, names.ADAPTERS.list, names.TENANTS]
    return {
        "submitter": {
            "publish": api + watch + datasets + list(names.evals_api()) + [names.ADAPTERS.list, names.ADAPTERS.show],
            "subscribe": [],
        },
        "operator": {
            "publish": api + watch + datasets + operates + _object_read() + [nats_subjects.SERVICE_DISCOVERY_ALL],
            "subscribe": [names.HEARTBEATS_ALL],
        },
        "dashboard": {
            "publish": shown + watch + _pulled(JOBS) + _object_read() + _dashboard_reads(),
            "subscribe": [names.HEARTBEATS_ALL],
        },
        "monitor": {"publish": [nats_subjects.SERVICE_DISCOVERY_ALL], "subscribe": []},  # $SRV.PING, INFO, STATS only
    }


def _dashboard_reads() -> list[str]:
    """What the dashboard shows besides jobs, nodes, adapters and tenants: eval runs, and the Tinker sessions as
    stored."""
    stores = [nats_subjects.kv(names.TINKER_KV).stream, nats_subjects.kv(names.TINKER_FUTURES_KV).stream]
    return [names.evals_api().runs] + [s for store in stores for s in _read_stream(store)]


def _tenant(tenant: str) -> dict:
    """Its own verbs only: it sees, cancels and stops its own jobs, and follows their events live."""
    names.check_tenant(tenant)
    publishes = list(names.jobs_api(tenant)) + list(names.artifacts_api(tenant)) + list(names.datasets_api(tenant))
    publishes += list(names.evals_api(tenant))
    return {"publish": publishes + [names.dataset_upload("*", tenant)], "subscribe": [names.tenant_events(tenant)]}


def _agent(node: str) -> dict:
    """What a node's agent sends is under its own node id; it reads checkpoints, datasets and the registry; it
    answers its own node's requests, and discovery ($SRV) for its service alone."""
    names.check_token(node, "node id")
    job = names.job("*", node)
    publishes = [names.node(node).heartbeat, job.state, job.progress, job.preparing, job.samples]
    publishes += [
        names.artifact_upload(node, "*"),
        nats_subjects.js_api("INFO"),
        nats_subjects.js_api("STREAM", "INFO", JOBS),
    ]
    publishes += [f"{ADAPTERS.prefix}node.*.{node}", names.adapter_status(node)]  # what its engines loaded
    publishes += _object_read() + _read_stream(DATA) + _read_stream(ADAPTERS.stream)
    publishes += [
        nats_subjects.js_api("STREAM", "MSG", "GET", LEASE_STREAM)
    ]  # the leading term: older ones are refused
    publishes += [TRAINER_LEASES.subjects, *_read_stream(TRAINER_LEASES.stream)]  # which attempt of a job computes
    return {
        "publish": publishes,
        "subscribe": [
            names.node(node).assign,
            names.node(node).control,
            names.node(node).reclaim,
            names.node(node).session,
            names.node(node).evaluate,
            *nats_subjects.service_discovery(names.AGENT_SERVICE),  # its endpoints are a nats.micro service's
        ],
    }


def _scheduler_consumer() -> list[str]:
    """The scheduler's durable consumer of job states: nobody else may create, change, delete, read or ack it."""
    consumer = names.SCHEDULER_CONSUMER
    return [
        nats_subjects.js_api("CONSUMER", "*", JOBS, consumer),
        nats_subjects.js_api("CONSUMER", "*", JOBS, consumer, ">"),
        nats_subjects.js_api("CONSUMER", "*", "*", JOBS, consumer),
        nats_subjects.js_api("CONSUMER", "MSG", "NEXT", JOBS, consumer),
        nats_subjects.js_acks(JOBS),
    ]


DASHBOARD_PAGE_NOTE = (  # the page sends no password (a browser would show it to anyone who opens the page)
    "# The dashboard's page connects over the websocket listener and sends no password: give that listener\n"
    "# `no_auth_user: dashboard`, so its connections are the dashboard user below and may do nothing more."
)


def env_var(user: str) -> str:
    return "JETLORA_" + user.upper().replace("-", "_") + "_PASSWORD"


def authorization_block(nodes: list[str], tenants: Sequence[str] = ()) -> str:
    lines = [DASHBOARD_PAGE_NOTE, "authorization {", "  users = ["]
    for user, perms in roles(nodes, tenants).items():
        lines.append(f"    {{ user: {json.dumps(user)}, password: ${env_var(user)}, permissions: {{")
        deny = f", deny: {json.dumps(perms['deny_publish'])}" if perms.get("deny_publish") else ""
        lines.append(f"        publish: {{ allow: {json.dumps(perms['publish'])}{deny} }},")
        lines.append(f"        subscribe: {{ allow: {json.dumps(perms['subscribe'])} }},")
        # a reply to whoever asked; several to one request: one process serves several micro services (the
        # scheduler's and the registry's), and each answers a $SRV.PING
        lines.append(f"        allow_responses: {{ max: {RESPONSES_PER_REQUEST} }} }} }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"
