"""Write the JSON Schema of every message and an AsyncAPI 3 document of every subject: `jetlora schema`."""

from __future__ import annotations

import json
from typing import Any
from pathlib import Path

import msgspec

from schemas import names
from schemas.catalogue import MESSAGES
from schemas.channels import CHANNELS

HERE = Path(__file__).parent


def json_schemas() -> dict:
    out = {}
    for name, t in MESSAGES.items():
        out[name] = msgspec.json.schema(t)
    return out


def asyncapi() -> dict:
    channels, operations = {}, {}
    for address, kind, message, reply, who, what in CHANNELS:
        cid = address.replace(".", "_").replace("{", "").replace("}", "")
        params = {
            p: {"description": f"the {p} id"} for p in ("node", "job", "tenant", "dataset") if "{" + p + "}" in address
        }
        ch = {"address": address, "description": what, "messages": {}}
        if params:
            ch["parameters"] = params
        if message:
            ch["messages"][message] = {"$ref": f"#/components/messages/{message}"}
        channels[cid] = ch
        op: dict[str, Any] = {"action": "send", "channel": {"$ref": f"#/channels/{cid}"}, "summary": f"{who}: {what}"}
        if message:
            op["messages"] = [{"$ref": f"#/channels/{cid}/messages/{message}"}]
        if reply:
            rid = cid + "_reply"
            channels[rid] = {
                "address": None,
                "description": f"the reply inbox of {address}",
                "messages": {reply: {"$ref": f"#/components/messages/{reply}"}},
            }
            op["reply"] = {"channel": {"$ref": f"#/channels/{rid}"}}
        operations[cid] = op
    messages = {
        n: {
            "name": n,
            "contentType": "application/msgpack" if n == "Chunk" else "application/json",
            "payload": {"$ref": f"json/{n}.json"},
        }
        for n in MESSAGES
    }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "jetlora",
            "version": "0.1.0",
            "description": "Distributed LoRA fine-tuning over NATS. JetStream: stream "
            f"{names.JOBS_STREAM} ({names.JOBS_STREAM_SUBJECTS[0]}), KV {names.JOBS_KV}, "
            f"object store {names.ARTIFACTS_BUCKET}.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages},
    }


def rendered() -> dict[str, str]:
    """File name (relative to schemas/) -> content."""
    files = {f"json/{n}.json": json.dumps(s, indent=2, sort_keys=True) + "\n" for n, s in json_schemas().items()}
    files["asyncapi.json"] = json.dumps(asyncapi(), indent=2) + "\n"
    return files


def write_all(out: Path | None = None) -> list[Path]:
    out = out or HERE
    paths = []
    for rel, text in rendered().items():
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        paths.append(p)
    return paths
