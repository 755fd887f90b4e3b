"""What a Tinker client was told lives in JetStream, not in one gateway: the official client's training loop goes
on across a restart of its gateway (its calls in flight finish, none runs twice, the steps follow each other), and
a client whose every request lands on the other of two gateways trains as if there were one."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.outcomes import NORM_METRIC, STEP_METRIC
from tests.conftest import ROOT, wait_for, wait_nodes
from tests.test_tinker_api import datums, key_for

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")
STEPS = 10


def models(tiny_model) -> dict:
    return {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}


def train(
    port: int, key: str, halfway: threading.Event | None = None, steps: int = STEPS
) -> list[tuple[float, float, float]]:
    """The cookbook's loop through the official client (forward_backward and optim_step sent together): the
    optimizer step, loss per token and gradient norm of each step."""
    import tinker
    from tinker import types

    with tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        batch, weighed = datums(tc.get_tokenizer(), types)
        out = []
        for n in range(steps):
            fb = tc.forward_backward(batch, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics
            out.append((opt[STEP_METRIC], fb.result().metrics["loss:sum"] / weighed, opt[NORM_METRIC]))
            if halfway is not None and n == steps // 2 - 1:
                halfway.set()
        return out


async def test_a_clients_loop_goes_on_across_a_restart_of_its_gateway(nc, stack, tiny_model, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gw = Gateway(nc, models(tiny_model), port=0)
    await gw.start()
    port, halfway = gw.port, threading.Event()
    loop = asyncio.create_task(asyncio.to_thread(train, port, await key_for(nc, "acme"), halfway))
    try:
        # a thread left waiting keeps pytest from exiting: the wait takes its timeout in the thread
        assert await asyncio.to_thread(halfway.wait, 120), "the loop never got halfway"
        await gw.close()  # calls in flight: the client retries, the next gateway answers them from the store
        gw = Gateway(nc, models(tiny_model), port=port)
        await gw.start()
        steps = await asyncio.wait_for(loop, 180)
    finally:
        await gw.close()
    print("steps and losses:", steps)
    assert [s for s, _, _ in steps] == [float(n) for n in range(1, STEPS + 1)]  # none lost, none run twice
    assert steps[-1][1] < 0.8 * steps[0][1]


def gateway_process(url: str, port: int, tiny_model, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "gateway", "--nats", url, "--port", str(port),
         "--base-model", f"tiny={tiny_model}", "--accelerator", "cpu"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_a_clients_loop_goes_on_after_its_gateway_is_killed(nc, stack, tiny_model, agents, nats_server, tmp_path):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "gateways.log", "ab")
    first = gateway_process(nats_server.url, port, tiny_model, log)
    second = None
    try:
        await wait_for(lambda: listening(port), timeout=60, what="the gateway listening")
        halfway = threading.Event()
        loop = asyncio.create_task(asyncio.to_thread(train, port, await key_for(nc, "acme"), halfway))
        # a thread left waiting keeps pytest from exiting: the wait takes its timeout in the thread
        assert await asyncio.to_thread(halfway.wait, 120), "the loop never got halfway"
        first.send_signal(signal.SIGKILL)  # no goodbye: its models are taken over once it is not heard of
        first.wait()
        second = gateway_process(nats_server.url, port, tiny_model, log)
        steps = await asyncio.wait_for(loop, 180)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    print("steps and losses:", steps)
    assert [s for s, _, _ in steps] == [float(n) for n in range(1, STEPS + 1)]
    assert steps[-1][1] < 0.8 * steps[0][1]


class RoundRobin:
    """An HTTP proxy that sends each request to the next of its gateways in turn."""

    def __init__(self, ports: list[int]) -> None:
        self.ports, self.turn, self.served = ports, itertools.cycle(range(len(ports))), [0] * len(ports)

    async def start(self) -> int:
        self.http = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return self.runner.addresses[0][1]

    async def forward(self, request: web.Request) -> web.Response:
        n = next(self.turn)
        self.served[n] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("x-api-key", "content-type")}
        url = f"http://127.0.0.1:{self.ports[n]}{request.rel_url}"
        async with self.http.request(request.method, url, data=await request.read(), headers=headers) as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    async def close(self) -> None:
        if hasattr(self, "runner"):  # started
            await self.runner.cleanup()
            await self.http.close()


@contextlib.asynccontextmanager
async def two_gateways(nc, tiny_model, agents) -> AsyncIterator[tuple[list[Gateway], RoundRobin]]:
    """A CPU node "box", two gateways, and a front that sends a client's requests to each in turn (not started)."""
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gateways = [Gateway(nc, models(tiny_model), port=0), Gateway(nc, models(tiny_model), port=0)]
    for gw in gateways:
        await gw.start()
    front = RoundRobin([gw.port for gw in gateways])
    try:
        yield gateways, front
    finally:
        await front.close()
        for gw in gateways:
            await gw.close()


async def test_a_client_whose_requests_alternate_between_two_gateways_trains_as_with_one(nc, stack, tiny_model, agents):
    async with two_gateways(nc, tiny_model, agents) as (_, proxy):
        port = await proxy.start()
        steps = await asyncio.wait_for(asyncio.to_thread(train, port, await key_for(nc, "acme")), 240)
    print("steps and losses:", steps, "requests per gateway:", proxy.served)
    assert [s for s, _, _ in steps] == [float(n) for n in range(1, STEPS + 1)]
    assert steps[-1][1] < 0.8 * steps[0][1]
    assert min(proxy.served) > 2 * STEPS  # each gateway took calls, fetches and heartbeats
