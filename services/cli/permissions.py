"""Per-role NATS users and their subject permissions, derived from `names` (so they cannot drift from it).

`jetlora permissions --nodes gpu1,gpu2` writes the `authorization` block of a nats-server config.
Passwords are never written: each user's password is `$JETLORA_<USER>_PASSWORD` in nats-server's
environment (nats-server expands `$VAR` in its config), so the repository holds none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from schemas import names

JOBS, OBJ = names.JOBS_STREAM, names.objects(names.ARTIFACTS_BUCKET).stream
DATA = names.objects(names.DATASETS_BUCKET).stream
ADAPTERS = names.kv(names.ADAPTERS_KV)


def _read_stream(stream: str) -> list[str]:
    """What a client needs to read a stream with an ordered consumer (and info and direct gets)."""
    return [
        names.js_api("INFO"),
        names.js_api("STREAM", "INFO", stream),
        names.js_api("CONSUMER", "CREATE", stream, ">"),
        names.js_api("CONSUMER", "CREATE", stream),
        names.js_api("CONSUMER", "DELETE", stream, ">"),
        names.js_api("CONSUMER", "INFO", stream, ">"),
        names.js_api("DIRECT", "GET", stream, ">"),
        names.js_api("DIRECT", "GET", stream),
        names.js_api("STREAM", "MSG", "GET", stream),
        names.js_api("STREAM", "NAMES"),
    ]


def _object_read() -> list[str]:
    return _read_stream(OBJ)


def roles(nodes: list[str], tenants: Sequence[str] = ()) -> dict[str, dict]:
    api = list(names.jobs_api()) + [names.LIST_NODES]  # an admin's
    datasets = [names.DATASETS_UPLOAD_ALL, names.DATASETS.list, names.DATASETS.show] + _read_stream(DATA)
    watch = _read_stream(JOBS)
    users = {
        "scheduler": {
            "publish": [
                names.node("*").assign,
                names.node("*").control,
                names.JS_API_ALL,
                names.kv(names.JOBS_KV).subjects,
                names.kv(names.LEASE_KV).subjects,
                ADAPTERS.subjects,
                names.js_acks(JOBS),
                names.kv(names.IDEMPOTENCY_KV).subjects,
                *names.JOB_INDEX_SUBJECTS,
                names.ARTIFACTS_DELETE,
                names.SERVICE_DISCOVERY_ALL,
            ],
            "subscribe": [
                names.API_GROUP + ".>",
                names.ADAPTERS_GROUP + ".>",
                names.HEARTBEATS_ALL,
                names.JOB_PROGRESS_ALL,
                names.SERVICE_DISCOVERY_ALL,
            ],
        },
        "artifacts": {
            "publish": [
                names.objects(names.ARTIFACTS_BUCKET).subjects,
                names.objects(names.DATASETS_BUCKET).subjects,
                names.JS_API_ALL,
                names.SERVICE_DISCOVERY_ALL,
            ],
            "subscribe": [names.ARTIFACTS_GROUP + ".>", names.DATASETS_GROUP + ".>", names.SERVICE_DISCOVERY_ALL],
        },
        "submitter": {"publish": api + watch + datasets + [names.ADAPTERS.list, names.ADAPTERS.show], "subscribe": []},
        "operator": {
            "publish": api
            + watch
            + datasets
            + list(names.ADAPTERS)
            + [names.DATASETS.delete, names.node("*").reclaim]
            + [names.ARTIFACTS_LIST, names.ARTIFACTS_DELETE]
            + _object_read()
            + [names.js_api("STREAM", "PURGE", OBJ), names.objects(names.ARTIFACTS_BUCKET).subjects],
            "subscribe": [names.HEARTBEATS_ALL],
        },
        "dashboard": {
            "publish": [names.LIST_JOBS, names.LIST_NODES, names.ARTIFACTS_LIST, names.ADAPTERS.list]
            + watch
            + _object_read(),
            "subscribe": [names.HEARTBEATS_ALL],
        },
    }
    any_tenant = "*"  # the gateway acts for the tenant of each request's key: a tenant's verbs, never an admin's
    users["gateway"] = {
        "publish": list(names.jobs_api(any_tenant))
        + list(names.datasets_api(any_tenant))
        + [names.dataset_upload("*", any_tenant)]
        + _read_stream(names.kv(names.KEYS_KV).stream)
        + _read_stream(names.kv(names.GATEWAY_JOBS_KV).stream)
        + [
            names.kv(names.GATEWAY_JOBS_KV).subjects,
            names.js_api("STREAM", "INFO", "*"),
            names.ADAPTERS.show,
        ],  # a fine-tuned model named as `model`: its base
        "subscribe": [],
    }
    users["operator"]["publish"] += [names.kv(names.KEYS_KV).subjects] + _read_stream(names.kv(names.KEYS_KV).stream)
    for tenant in tenants:  # its own verbs only: it sees, cancels and stops its own jobs
        names.check_tenant(tenant)
        users[f"tenant-{tenant}"] = {
            "publish": list(names.jobs_api(tenant))
            + list(names.artifacts_api(tenant))
            + list(names.datasets_api(tenant))
            + [names.dataset_upload("*", tenant)],
            "subscribe": [names.tenant_events(tenant)],
        }  # its own jobs' events, live
    for node in nodes:
        names.check_token(node, "node id")
        users[f"agent-{node}"] = {
            "publish": [
                names.node(node).heartbeat,
                names.job("*", node).state,
                names.job("*", node).progress,
                names.job("*", node).preparing,
                names.job("*", node).samples,
                names.artifact_upload(node, "*"),
                names.js_api("INFO"),
                names.js_api("STREAM", "INFO", JOBS),
            ]
            + [f"{ADAPTERS.prefix}node.*.{node}", names.adapter_status(node)]  # what its engines loaded
            + _object_read()
            + _read_stream(DATA)
            + _read_stream(ADAPTERS.stream),  # checkpoints,
            # datasets to train on, the registry to follow
            "subscribe": [names.node(node).assign, names.node(node).control, names.node(node).reclaim],
        }
    for user, perms in users.items():  # replies come to each user's own inbox, which no other user may read
        perms["subscribe"].append(names.inbox_all(user))
        if user != "scheduler":
            perms["deny_publish"] = _scheduler_consumer()
    return users


def _scheduler_consumer() -> list[str]:
    """The scheduler's durable consumer of job states: nobody else may create, change, delete, read or ack it."""
    consumer = names.SCHEDULER_CONSUMER
    return [
        names.js_api("CONSUMER", "*", JOBS, consumer),
        names.js_api("CONSUMER", "*", JOBS, consumer, ">"),
        names.js_api("CONSUMER", "*", "*", JOBS, consumer),
        names.js_api("CONSUMER", "MSG", "NEXT", JOBS, consumer),
        names.js_acks(JOBS),
    ]


def env_var(user: str) -> str:
    return "JETLORA_" + user.upper().replace("-", "_") + "_PASSWORD"


def authorization_block(nodes: list[str], tenants: Sequence[str] = ()) -> str:
    lines = ["authorization {", "  users = ["]
    for user, perms in roles(nodes, tenants).items():
        lines.append(f"    {{ user: {json.dumps(user)}, password: ${env_var(user)}, permissions: {{")
        deny = f", deny: {json.dumps(perms['deny_publish'])}" if perms.get("deny_publish") else ""
        lines.append(f"        publish: {{ allow: {json.dumps(perms['publish'])}{deny} }},")
        lines.append(f"        subscribe: {{ allow: {json.dumps(perms['subscribe'])} }},")
        lines.append("        allow_responses: true } }")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"
