"""What the gateway reads of a request's body: a JSON request is refused past a few MiB (413, OpenAI's error shape)
without the gateway's memory growing by what was sent, measured on `jetlora gateway` as a process of its own; an
upload is streamed to a spool file, which is removed however the request ends (two files in one form, a client
cut off mid-file)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

from services.gateway.app import Gateway
from services.gateway.keys import KeyStore, new_key
from services.gateway.openai_map import BaseModel
from tests.conftest import ROOT, wait_for
from tests.test_gateway import chat_file, client_for

MIB = 2**20


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) / 1024


@pytest.fixture
async def gateway_process(stack, nats_server, nc, tmp_path):
    """`jetlora gateway` as its own process, and a key of tenant acme for it."""
    cmd = [sys.executable, "-m", "services.cli", "gateway", "--nats", nats_server.url, "--port", "0"]
    cmd += ["--base-model", "tiny=/models/tiny"]
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:

        def listening():
            assert proc.poll() is None, log.read_text()
            return re.search(r"gateway: (http://\S+)", log.read_text())

        found = await wait_for(listening, 60, interval=0.1, what="the gateway listening")
        key, record = new_key("acme")
        await (await KeyStore.open(nc.jetstream())).put(record)
        yield proc, found[1], key
    finally:
        proc.terminate()
        proc.wait(15)


async def chunks(total_mib: int):
    """A JSON body of `total_mib` MiB, sent in chunks (no Content-Length: the server finds its size by reading)."""
    yield b'{"model": "tiny", "training_file": "file-x", "metadata": {"k": "'
    for _ in range(total_mib):
        yield b"a" * MIB
    yield b'"}}'


async def test_a_large_json_body_is_refused_without_being_read_whole(gateway_process, tmp_path):
    proc, base, key = gateway_process
    auth = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/fine_tuning/jobs", headers=auth) as r:  # warm: every handler's imports done
            assert r.status == 200
        before = peak_rss_mib(proc.pid)
        async with http.post(f"{base}/fine_tuning/jobs", data=chunks(160), headers=auth) as r:
            status, body = r.status, await r.json()
        grown = peak_rss_mib(proc.pid) - before
        print(f"peak RSS grew {grown:.1f} MiB")
        assert grown < 48, f"the gateway's peak memory grew {grown:.0f} MiB for a 160 MiB body: {status} {body}"
        assert status == 413 and body["error"]["code"] == "request_too_large", body
        assert "POST /v1/files" in body["error"]["message"]
        declared = b"{" + b" " * (5 * MIB) + b"}"  # a Content-Length over the limit: refused before reading
        async with http.post(f"{base}/fine_tuning/jobs", data=declared, headers=auth) as r:
            assert r.status == 413 and (await r.json())["error"]["type"] == "invalid_request_error"
    client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)  # an upload is no JSON body: not limited
    rows = Path(chat_file(tmp_path / "rows.jsonl")).read_bytes()
    big = tmp_path / "big.jsonl"
    big.write_bytes(rows * (6 * MIB // len(rows) + 1))
    with open(big, "rb") as f:
        uploaded = await client.files.create(file=f, purpose="fine-tune")
    assert uploaded.bytes > 6 * MIB


@pytest.fixture
async def spooling(stack, nc, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    gw = Gateway(nc, {"tiny": BaseModel("tiny", "/models/tiny")}, port=0, spool_dir=str(spool))
    await gw.start()
    yield gw, spool
    await gw.close()


async def test_a_form_with_two_files_is_refused_and_leaves_no_spool_file(nc, spooling, tmp_path):
    gw, spool = spooling
    client = await client_for(nc, gw, "acme")
    good = Path(chat_file(tmp_path / "d.jsonl")).read_bytes()
    form = aiohttp.FormData()
    form.add_field("purpose", "fine-tune")
    form.add_field("file", good, filename="a.jsonl")
    form.add_field("file", good, filename="b.jsonl")
    async with aiohttp.ClientSession() as http:
        url, auth = f"http://127.0.0.1:{gw.port}/v1/files", {"Authorization": f"Bearer {client.api_key}"}
        async with http.post(url, data=form, headers=auth) as r:
            status, body = r.status, await r.json()
    assert os.listdir(spool) == [], (status, body)
    assert status == 400 and body["error"]["param"] == "file" and "one file" in body["error"]["message"], body


async def test_an_upload_cut_off_mid_file_leaves_no_spool_file(nc, spooling, tmp_path):
    gw, spool = spooling
    client = await client_for(nc, gw, "acme")
    good = Path(chat_file(tmp_path / "d.jsonl")).read_bytes()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    boundary = "jetlora-test-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="d.jsonl"\r\n\r\n'
    ).encode()
    request = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {client.api_key}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(head) + 64 * MIB}\r\n\r\n"
    ).encode()
    writer.write(request + head + good * (MIB // len(good) + 1))  # a MiB of the 64 promised
    await writer.drain()
    await wait_for(lambda: os.listdir(spool), 20, what="the upload spooled")
    writer.close()  # the client goes away mid-file
    await wait_for(lambda: os.listdir(spool) == [], 20, what="the spool file removed")
    assert [f.id for f in (await client.files.list()).data] == []
