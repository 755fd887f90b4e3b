"""The OpenAI routes under 500 malformed requests (a seeded generator: good bodies with one part broken, numbers no
store keeps, wrong types, unknown and missing fields, cut and garbled bytes, odd ids and queries), on the real
stack: no answer is a 5xx, every refusal is OpenAI's error shape, and afterwards every object the tenant has (files,
jobs, evals, runs, output items, models) reads back without a 5xx, so nothing half-made was stored."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp
import pytest

from schemas import names, nats_subjects
from services.evals.service import EvalsService
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.graders import GraderContext
from tests.conftest import wait_for
from tests.test_gateway import client_for
from tests.test_gateway_door import ROWS, upload
from tests.test_gateway_evals import ITEM_SCHEMA, ended
from tests.test_gates import SAYS_ANSWER
from tests.test_grpo import SAYS_PARIS, rft_rows

REQUESTS = 500
SEED = 55
RAW = "\x00raw:"  # a string that becomes the JSON text after it, unquoted (numbers JSON has no value for)
NASTY: list[Any] = [
    None, True, False, 0, -1, 2**31, 2**63, -(2**63) - 1, 1e308, -1e-320, 0.5, "", " ", "x" * 5000, "ü\u200b",
    "{{item.x}}", "{{", "auto", "../../etc", [], {}, [[[]]], {"a": {"b": {"c": []}}}, [None] * 50,
    f"{RAW}1e400", f"{RAW}-1e999", f"{RAW}NaN", f"{RAW}Infinity", f"{RAW}{'9' * 500}", f"{RAW}{'[' * 300}{']' * 300}",
]  # fmt: skip


class Fuzz:
    """Request bodies and queries from a seeded generator: a good one with one thing broken."""

    def __init__(self, seed: int, ids: dict[str, str]) -> None:
        self.rng, self.ids = random.Random(seed), ids

    def value(self) -> Any:
        return self.rng.choice(NASTY)

    def broken(self, body: Any, depth: int = 0) -> Any:
        """`body` with one value somewhere replaced, removed or joined by an unknown one."""
        rng = self.rng
        if not isinstance(body, (dict, list)) or not body or (depth and rng.random() < 0.3):
            return self.value()
        if isinstance(body, dict):
            key = rng.choice(list(body))
            out = dict(body)
            roll = rng.random()
            if roll < 0.2:
                del out[key]
            elif roll < 0.3:
                out[rng.choice(["extra", "type", "name", "n_epochs", "grader"])] = self.value()
            else:
                out[key] = self.broken(body[key], depth + 1)
            return out
        at = rng.randrange(len(body))
        return [self.broken(v, depth + 1) if n == at else v for n, v in enumerate(body)]

    def encoded(self, body: Any) -> bytes:
        text = json.dumps(body)
        for raw in [v for v in NASTY if isinstance(v, str) and v.startswith(RAW)]:
            text = text.replace(json.dumps(raw), raw[len(RAW) :])
        data = text.encode()
        roll = self.rng.random()
        if roll < 0.05:
            return data[: self.rng.randrange(len(data) + 1)]  # cut off
        if roll < 0.08:
            at = self.rng.randrange(len(data) + 1)
            return data[:at] + bytes(self.rng.randrange(256) for _ in range(3)) + data[at:]  # garbled
        return data

    def ident(self, kind: str) -> str:
        odd = ["nope", "a.b", "%2e%2e", "x" * 300, "ü", "file-results-x", "ft-x:ckpt-1", ""]
        if kind == "item":
            item = self.ids["item"].rpartition("_")[0]
            odd += [f"{item}_{'9' * 30}", f"{item}_-1", f"{item}_٣", f"{item}_"]
        return self.rng.choice([self.ids.get(kind, "x"), *odd])

    def query(self) -> dict[str, str]:
        keys = ["limit", "after", "order", "status", "order_by", "purpose", "metadata", "metadata[k]"]
        item = self.ids["item"].rpartition("_")[0]
        values = ["0", "1", "-5", "1e3", "100000", "", "desc", "asc", "pass", "x", "null", "9" * 50, self.ids["item"]]
        values += [f"{item}_{'9' * 30}", f"{item}_٣", self.ids["job"], self.ids["file"], self.ids["run"]]
        return {k: self.rng.choice(values) for k in self.rng.sample(keys, self.rng.randrange(3))}


def bodies(ids: dict[str, str]) -> list[tuple[str, str, Any]]:
    """The good requests the broken ones are made from: (method, path, body)."""
    template = {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]}
    content = {"type": "file_content", "content": ROWS[:2]}
    python = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}
    return [
        ("POST", "/v1/fine_tuning/jobs", {"model": "tiny", "training_file": ids["file"], "seed": 1, "suffix": "s"}),
        (
            "POST",
            "/v1/fine_tuning/jobs",
            {
                "model": "tiny",
                "training_file": ids["rft"],
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {"grader": SAYS_ANSWER, "hyperparameters": {"n_epochs": 1, "eval_samples": 2}},
                },
            },
        ),
        ("POST", "/v1/fine_tuning/alpha/graders/validate", {"grader": SAYS_PARIS}),
        ("POST", "/v1/fine_tuning/alpha/graders/validate", {"grader": python}),
        (
            "POST",
            "/v1/fine_tuning/alpha/graders/run",
            {"grader": SAYS_ANSWER, "model_sample": "a", "item": {"answer": "a"}},
        ),
        (
            "POST",
            "/v1/evals",
            {
                "name": "e",
                "data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA, "include_sample_schema": True},
                "testing_criteria": [{**SAYS_ANSWER, "pass_threshold": 0.5}],
                "metadata": {"k": "v"},
            },
        ),
        ("POST", f"/v1/evals/{ids['eval']}", {"name": "renamed", "metadata": {"k": "w"}}),
        ("POST", f"/v1/evals/{ids['eval']}/runs", {"name": "r", "data_source": {"type": "jsonl", "source": content}}),
        (
            "POST",
            f"/v1/evals/{ids['eval']}/runs",
            {
                "data_source": {
                    "type": "completions",
                    "model": "tiny",
                    "source": {"type": "file_id", "id": ids["evals_file"]},
                    "input_messages": template,
                    "sampling_params": {"temperature": 0, "max_completion_tokens": 8, "seed": 1},
                }
            },
        ),
    ]


READS = [
    ("GET", "/v1/files"),
    ("GET", "/v1/files/{file}"),
    ("GET", "/v1/files/{file}/content"),
    ("DELETE", "/v1/files/{file}"),
    ("GET", "/v1/fine_tuning/jobs"),
    ("GET", "/v1/fine_tuning/jobs/{job}"),
    ("GET", "/v1/fine_tuning/jobs/{job}/events"),
    ("GET", "/v1/fine_tuning/jobs/{job}/checkpoints"),
    ("POST", "/v1/fine_tuning/jobs/{job}/pause"),
    ("GET", "/v1/evals"),
    ("GET", "/v1/evals/{eval}"),
    ("GET", "/v1/evals/{eval}/runs"),
    ("GET", "/v1/evals/{eval}/runs/{run}"),
    ("GET", "/v1/evals/{eval}/runs/{run}/output_items"),
    ("GET", "/v1/evals/{eval}/runs/{run}/output_items/{item}"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("DELETE", "/v1/models/{model}"),
]


def upload_form(fuzz: Fuzz) -> aiohttp.FormData:
    form = aiohttp.FormData()
    rng = fuzz.rng
    if rng.random() < 0.8:
        form.add_field("purpose", rng.choice(["fine-tune", "evals", "batch", "", "x" * 2000]))
    rows = rng.choice([rft_rows(), ROWS, [{"q": 1}], []])
    data = fuzz.encoded(rows).replace(b"}, {", b"}\n{") if rows else b""
    if rng.random() < 0.9:
        form.add_field("file", data, filename=rng.choice(["a.jsonl", "", "../x", "ü" * 300]))
    return form


async def answer(http: aiohttp.ClientSession, method: str, url: str, **kw) -> tuple[int, Any]:
    async with http.request(method, url, **kw) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


def well_formed(status: int, body: Any) -> bool:
    if status < 400:
        return True
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error


@pytest.fixture
async def fuzzed(stack, nc, services, tmp_path):
    service, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(service.ready.is_set, timeout=10, what="the evals service")
    await nc.jetstream().purge_stream(nats_subjects.kv(names.GATEWAY_JOBS_KV).stream)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", "/models/tiny")}, port=0, graders=GraderContext(wall_s=2.0))
    await gw.start()
    client = await client_for(nc, gw, "acme")
    ids = {
        "file": await upload(
            client,
            tmp_path / "chat.jsonl",
            [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
        ),
        "rft": await upload(client, tmp_path / "rft.jsonl", rft_rows()),
        "evals_file": await upload(client, tmp_path / "evals.jsonl", ROWS, purpose="evals"),
        "model": "tiny",
    }
    e = await client.evals.create(
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[SAYS_ANSWER]
    )
    run = await client.evals.runs.create(
        e.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": ROWS}}
    )
    await ended(client, e.id, run.id)
    job = await client.fine_tuning.jobs.create(model="tiny", training_file=ids["file"])
    ids |= {"eval": e.id, "run": run.id, "job": job.id, "item": f"outputitem_{run.id.removeprefix('evalrun_')}_1"}
    yield gw, client, ids
    await gw.close()


async def test_malformed_requests_get_no_5xx_and_leave_nothing_that_answers_one(fuzzed):
    gw, client, ids = fuzzed
    fuzz, base = Fuzz(SEED, ids), f"http://127.0.0.1:{gw.port}"
    auth = {"Authorization": f"Bearer {client.api_key}"}
    templates = bodies(ids)
    started, seen, bad = time.monotonic(), {}, []
    turns = asyncio.Semaphore(4)

    async def one(n: int, http: aiohttp.ClientSession) -> None:
        roll = fuzz.rng.random()
        if roll < 0.6:
            method, path, body = fuzz.rng.choice(templates)
            kw: dict[str, Any] = {
                "data": fuzz.encoded(fuzz.broken(body)),
                "headers": {**auth, "Content-Type": "application/json"},
            }
        elif roll < 0.75:
            method, path, kw = "POST", "/v1/files", {"data": upload_form(fuzz), "headers": auth}
        else:
            method, path = fuzz.rng.choice(READS)
            path = path.format(**{k: fuzz.ident(k) for k in ("file", "job", "eval", "run", "item", "model")})
            kw = {"params": fuzz.query(), "headers": auth}
        async with turns:
            status, answered = await answer(http, method, base + path, **kw)
        seen[status] = seen.get(status, 0) + 1
        if status >= 500 or not well_formed(status, answered):
            bad.append((method, path, status, str(answered)[:300], str(kw.get("data", kw.get("params")))[:300]))

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(one(n, http) for n in range(REQUESTS)))
        fuzzing = time.monotonic() - started
        print(f"{REQUESTS} malformed requests in {fuzzing:.1f} s: statuses {dict(sorted(seen.items()))}")
        assert not bad, bad[:5]
        assert sum(n for s, n in seen.items() if s >= 400) > REQUESTS // 2, seen  # they were malformed
        read = await read_everything(http, base, auth)
    print(f"then every stored object read back: {read} reads, none a 5xx")


async def read_everything(http: aiohttp.ClientSession, base: str, auth: dict[str, str]) -> int:
    """Every object of the tenant's read through each route that shows it; a 5xx fails the test."""
    reads = 0

    async def get(path: str, **params) -> Any:
        nonlocal reads
        status, body = await answer(http, "GET", base + path, headers=auth, params=params)
        reads += 1
        assert status < 500 and well_formed(status, body), (path, status, body)
        return body

    for f in (await get("/v1/files", limit=10000))["data"]:
        await get(f"/v1/files/{f['id']}")
    for j in (await get("/v1/fine_tuning/jobs", limit=100))["data"]:
        for tail in ("", "/events", "/checkpoints"):
            await get(f"/v1/fine_tuning/jobs/{j['id']}{tail}")
    for e in (await get("/v1/evals", limit=100))["data"]:
        await get(f"/v1/evals/{e['id']}")
        for r in (await get(f"/v1/evals/{e['id']}/runs", limit=100))["data"]:
            await get(f"/v1/evals/{e['id']}/runs/{r['id']}")
            for i in (await get(f"/v1/evals/{e['id']}/runs/{r['id']}/output_items", limit=100))["data"]:
                await get(f"/v1/evals/{e['id']}/runs/{r['id']}/output_items/{i['id']}")
    for m in (await get("/v1/models"))["data"]:
        await get(f"/v1/models/{m['id']}")
    return reads
