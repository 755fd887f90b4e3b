"""What a request may cost the gateway, on the real stack: an upload over the file limit or past the tenant's quota
is refused (413 naming it) while it streams, its spool file removed, nothing stored; an eval source's file with
more rows than a run takes is refused by its recorded count; a page of output items asks the evals service for
that page only; a number no store can keep (1e400, NaN, an integer past 64 bits) is a 400 naming its field; and a
fault no handler foresaw is a 500 in OpenAI's shape with a request id that the log and /healthz's count share."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
from aiohttp import web

from schemas import names
from schemas.evals import ItemsQuery
from services.evals.service import EvalsService
from services.gateway.evals import items as eval_items
from services.gateway.app import Gateway, make_app
from services.gateway.files import UploadLimits
from services.gateway.keys import KeyStore, new_key
from services.gateway.openai_map import BaseModel
from tests.conftest import wait_for
from tests.test_gateway import client_for
from tests.test_gateway_door import ROWS, upload
from tests.test_gateway_evals import ITEM_SCHEMA, ended
from tests.test_gates import SAYS_ANSWER

KIB = 1024
ROW = json.dumps({"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]})


@pytest.fixture
async def limited(stack, nc, services, tmp_path):
    """A gateway that takes files of up to 64 KiB, 160 KiB of them a tenant; and the evals service."""
    service, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(service.ready.is_set, timeout=10, what="the evals service")
    spool = tmp_path / "spool"
    spool.mkdir()
    uploads = UploadLimits(file_max=64 * KIB, tenant_max=160 * KIB)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", "/models/tiny")}, port=0, spool_dir=str(spool), uploads=uploads)
    await gw.start()
    yield gw, spool
    await gw.close()


def rows_of(kib: int) -> bytes:
    return ((ROW + "\n") * (kib * KIB // (len(ROW) + 1) + 1)).encode()


async def post_file(port: int, key: str, data: bytes, chunked: bool) -> tuple[int, dict]:
    """POST /v1/files with the file's bytes declared (Content-Length) or streamed without a length."""
    form = aiohttp.FormData()
    form.add_field("purpose", "fine-tune")
    form.add_field("file", data, filename="rows.jsonl")
    body: Any = form
    headers = {"Authorization": f"Bearer {key}"}
    if chunked:
        payload = form()
        headers["Content-Type"] = payload.content_type

        async def pieces():
            buffer = _Sink()
            await payload.write(buffer)
            for at in range(0, len(buffer.data), 16 * KIB):
                yield bytes(buffer.data[at : at + 16 * KIB])

        body = pieces()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{port}/v1/files", data=body, headers=headers) as r:
            return r.status, await r.json()


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    async def write(self, chunk: bytes) -> None:
        self.data += chunk


async def test_uploads_over_the_file_limit_or_the_quota_are_refused_as_they_stream(nc, limited):
    gw, spool = limited
    client = await client_for(nc, gw, "acme")
    key = client.api_key
    for kib, chunked in ((200, False), (80, True)):  # declared: refused before a byte is read; else as it streams
        status, body = await post_file(gw.port, key, rows_of(kib), chunked)
        assert status == 413 and body["error"]["code"] == "file_too_large" and body["error"]["param"] == "file", body
        assert "65,536 bytes" in body["error"]["message"] and "--file-max-mib" in body["error"]["message"]
        assert os.listdir(spool) == []
    stored = []
    for _ in range(3):  # 3 x 50 KiB: under the 160 KiB quota
        status, body = await post_file(gw.port, key, rows_of(50), chunked=True)
        assert status == 200, body
        stored.append(body["id"])
    status, body = await post_file(gw.port, key, rows_of(40), chunked=True)
    assert status == 413 and body["error"]["code"] == "quota_exceeded", body
    assert "163,840 bytes" in body["error"]["message"] and "DELETE /v1/files" in body["error"]["message"]
    assert os.listdir(spool) == [] and sorted(f.id for f in (await client.files.list()).data) == sorted(stored)
    other = await client_for(nc, gw, "globex")  # another tenant's quota is its own
    status, _ = await post_file(gw.port, other.api_key, rows_of(40), chunked=True)
    assert status == 200
    await client.files.delete(stored[0])
    status, body = await post_file(gw.port, key, rows_of(40), chunked=True)
    assert status == 200, body


async def test_an_eval_file_with_more_rows_than_a_run_takes_is_refused_by_its_count(nc, limited, tmp_path, monkeypatch):
    gw, _ = limited
    client = await client_for(nc, gw, "acme")
    e = await client.evals.create(
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[SAYS_ANSWER]
    )
    evals_file = await upload(client, tmp_path / "evals.jsonl", ROWS, purpose="evals")
    monkeypatch.setattr(eval_items, "ITEMS_MAX", len(ROWS) - 1)
    template = {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]}
    source = {"type": "file_id", "id": evals_file}
    with pytest.raises(openai.BadRequestError) as refused:
        await client.evals.runs.create(
            e.id, data_source={"type": "completions", "model": "tiny", "input_messages": template, "source": source}
        )
    assert refused.value.param == "data_source.source.id", refused.value.message
    assert f"has {len(ROWS)} rows; a run takes up to {len(ROWS) - 1}" in refused.value.message


async def test_a_page_of_output_items_asks_for_that_page(nc, limited):
    gw, _ = limited
    client = await client_for(nc, gw, "acme")
    e = await client.evals.create(
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[SAYS_ANSWER]
    )
    rows = [
        {"item": {"question": f"q{n}", "answer": "yes"}, "sample": {"output_text": "yes" if n % 3 else "no"}}
        for n in range(25)
    ]
    run = await client.evals.runs.create(
        e.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": rows}}
    )
    assert (await ended(client, e.id, run.id)).status == "completed"
    asked: list[ItemsQuery] = []

    async def seen(msg) -> None:  # each ask of the evals service for items, as it goes over NATS
        asked.append(msgspec.json.decode(msg.data, type=ItemsQuery))

    watch = await nc.subscribe(names.evals_api("acme").items, cb=seen)
    items = client.evals.runs.output_items

    async def page(**query) -> list[int]:
        asked.clear()
        got = await items.list(run.id, eval_id=e.id, **query)
        await nc.flush()
        return [i.datasource_item_id for i in got.data]

    try:
        assert await page(limit=5) == [0, 1, 2, 3, 4] and [q.limit for q in asked] == [6]
        assert await page(limit=5, order="desc") == [24, 23, 22, 21, 20] and [q.limit for q in asked] == [6]
        first = await items.list(run.id, eval_id=e.id, limit=5, order="desc")
        assert await page(limit=5, order="desc", after=first.data[-1].id) == [19, 18, 17, 16, 15]
        assert [(q.after, q.limit) for q in asked] == [(13, 6)]
        assert await page(limit=4, status="fail") == [0, 3, 6, 9] and len(asked) == 1
        assert await page(limit=3, order="desc", status="fail") == [24, 21, 18]
        walked = [i.datasource_item_id async for i in items.list(run.id, eval_id=e.id, limit=7)]
        assert walked == list(range(25))
        backwards = [i.datasource_item_id async for i in items.list(run.id, eval_id=e.id, limit=7, order="desc")]
        assert backwards == list(range(24, -1, -1))
    finally:
        await watch.unsubscribe()


async def raw(port: int, key: str, method: str, path: str, body: bytes) -> tuple[int, dict, Any]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"http://127.0.0.1:{port}{path}", data=body, headers=headers) as r:
            return r.status, await r.json(), r.headers


async def test_numbers_out_of_range_are_refused_naming_them(nc, limited):
    gw, _ = limited
    key = (await client_for(nc, gw, "acme")).api_key
    criterion = '{"type": "string_check", "name": "s", "input": "a", "reference": "b", "operation": "eq", '
    config = '"data_source_config": {"type": "custom", "item_schema": {"type": "object"}}'
    big = "1" + "0" * 400
    for method, path, body, param in (
        (
            "POST",
            "/v1/evals",
            f'{{{config}, "testing_criteria": [{criterion}"pass_threshold": 1e400}}]}}',
            "testing_criteria[0].pass_threshold",
        ),
        (
            "POST",
            "/v1/evals",
            f'{{{config}, "testing_criteria": [{criterion}"pass_threshold": -Infinity}}]}}',
            "testing_criteria[0].pass_threshold",
        ),
        (
            "POST",
            "/v1/evals",
            f'{{{config}, "testing_criteria": [{criterion}"pass_threshold": {big}}}]}}',
            "testing_criteria[0].pass_threshold",
        ),
        ("POST", "/v1/fine_tuning/jobs", '{"model": "tiny", "training_file": "f", "seed": NaN}', "seed"),
        (
            "POST",
            "/v1/fine_tuning/jobs",
            f'{{"model": "tiny", "training_file": "f", "hyperparameters": {{"n_epochs": {big}}}}}',
            "hyperparameters.n_epochs",
        ),
        (
            "POST",
            "/v1/fine_tuning/alpha/graders/run",
            f'{{"grader": {criterion[:-2]}}}, "model_sample": "a", "item": {{"x": [1, 2e999]}}}}',
            "item.x[1]",
        ),
    ):
        status, answer, _ = await raw(gw.port, key, method, path, body.encode())
        assert status == 400 and answer["error"]["param"] == param, (body[:120], answer)
        assert answer["error"]["code"] == "invalid_number", answer


async def test_a_fault_no_handler_foresaw_is_a_500_in_openais_shape_with_a_request_id(nc, caplog):
    js = nc.jetstream()
    key, record = new_key("acme")
    keys = await KeyStore.open(js)
    await keys.put(record)
    app = make_app(nc, keys, await js.key_value(names.GATEWAY_JOBS_KV), {})

    async def faulty(request: web.Request) -> web.Response:
        return web.json_response({"got": {}["missing"]})  # a bug: a KeyError nobody handles

    app.router.add_get("/v1/faulty", faulty)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        with caplog.at_level(logging.ERROR, logger="services.gateway.faults"):
            status, body, headers = await raw(port, key, "GET", "/v1/faulty", b"")
        ident = headers["x-request-id"]
        assert status == 500 and body["error"]["type"] == "server_error" and body["error"]["code"] == "internal_error"
        assert ident.startswith("req_") and ident in body["error"]["message"], body
        logged = [r for r in caplog.records if ident in r.getMessage()]
        assert logged and logged[0].exc_info and logged[0].exc_info[0] is KeyError, caplog.records
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert (await r.json())["faults"] == 1
        grader = {"type": "string_check", "name": "s", "input": "a", "reference": "a", "operation": "eq"}
        status, body, headers = await raw(
            port, key, "POST", "/v1/fine_tuning/alpha/graders/validate", json.dumps({"grader": grader}).encode()
        )
        assert status == 200 and headers["x-request-id"] != ident  # every answer has its own
    finally:
        await runner.cleanup()
