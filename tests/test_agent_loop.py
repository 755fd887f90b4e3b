"""Nothing on a node agent's event loop waits on an engine or the disk: the engine HTTP helpers (aiohttp, on the
loop) answer in the shapes their callers read, against a real local server; the device probe reads on a thread of
its own even while asyncio's shared pool is full; and a real agent whose engine accepts connections and never
answers keeps heartbeating at its interval."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import msgspec
import pytest
from aiohttp import web

from schemas import names
from schemas.nodes import Heartbeat
from services.agent.devices import DeviceProbe
from services.agent.engine_http import EngineHttp
from services.agent.engine_load import LoadWatch, fetch_in_flight, fetch_text
from services.agent.engines import get_json, post_json
from tests.conftest import wait_for, wait_nodes


class Hanging:
    """A local port that accepts connections and never answers (an engine wedged mid-request)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:  # closed
                return

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def refused_url() -> str:
    """An address where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def server():
    """A real aiohttp server: /json, /load, /metrics, /encoding (the Accept-Encoding asked for) and /echo answer 200,
    /broken 500, /slow not before the test ends, and any other path 404."""
    release = asyncio.Event()

    def answer(response):
        async def handler(_):
            return response()

        return handler

    async def slow(_):
        await release.wait()
        return web.json_response({})

    async def echo(request):
        return web.json_response(await request.json())

    async def encoding(request):
        return web.json_response(request.headers.get("Accept-Encoding"))

    app = web.Application()
    app.router.add_get("/json", answer(lambda: web.json_response({"data": [1]})))
    app.router.add_get("/load", answer(lambda: web.json_response({"server_load": 3})))
    app.router.add_get("/metrics", answer(lambda: web.Response(text="vllm:num_requests_running 2\n")))
    app.router.add_route("*", "/broken", answer(lambda: web.Response(status=500, text="it broke")))
    app.router.add_route("*", "/slow", slow)
    app.router.add_post("/echo", echo)
    app.router.add_get("/encoding", encoding)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    release.set()
    await runner.cleanup()


async def test_the_engine_http_helpers_answer_in_the_shapes_their_callers_read(server):
    http, refused = EngineHttp(), refused_url()
    try:
        # get_json: (status, body); (status, None) for an error status; (0, None) where nothing answers in time
        assert await get_json(f"{server}/json", http=http) == (200, {"data": [1]})
        assert await get_json(f"{server}/broken", http=http) == (500, None)
        assert await get_json(f"{server}/encoding", http=http) == (200, "identity")  # no compressing for us
        assert await get_json(f"{refused}/v1/models", http=http) == (0, None)
        t0 = time.monotonic()
        assert await get_json(f"{server}/slow", timeout=0.3, http=http) == (0, None)
        assert time.monotonic() - t0 < 2

        # post_json: (status, text) for any answer; an OSError that says why where none came
        assert await post_json(f"{server}/echo", {"lora_name": "a"}, http=http) == (200, '{"lora_name": "a"}')
        assert await post_json(f"{server}/broken", {}, http=http) == (500, "it broke")
        with pytest.raises(OSError, match="connection refused"):
            await post_json(f"{refused}/v1/load_lora_adapter", {}, http=http)
        with pytest.raises(OSError, match=r"no answer within 0.3s"):
            await post_json(f"{server}/slow", {}, timeout=0.3, http=http)

        # the load watch's reads: text, or an OSError (an error status, or no answer); /load absent is None
        assert await fetch_text(f"{server}/metrics", 1.0, http=http) == "vllm:num_requests_running 2\n"
        for url in (f"{server}/broken", f"{refused}/metrics", f"{server}/slow"):
            with pytest.raises(OSError):
                await fetch_text(url, 0.3, http=http)
        assert await fetch_in_flight(server, 1.0, http=http) == 3.0
        assert await fetch_in_flight(f"{server}/missing", 1.0, http=http) is None
    finally:
        await http.close()

    watch = LoadWatch("vllm nowhere", refused, [], timeout=0.5)
    try:
        assert await watch.poll() is None and watch.error == "connection refused at /load"  # not read: no guess
        assert watch.silent_for() >= 0 and watch.load().error == watch.error
    finally:
        await watch.close()


async def test_the_device_probe_reads_on_its_own_thread_while_the_shared_pool_is_full():
    threads: list[str] = []

    class Probe(DeviceProbe):
        def read(self):
            threads.append(threading.current_thread().name)
            return super().read()

    probe, gate = Probe(simulate="4096"), threading.Event()
    blocked = [asyncio.create_task(asyncio.to_thread(gate.wait)) for _ in range(40)]  # more than the pool's threads
    try:
        devices, reason = await asyncio.wait_for(probe.read_async(), 5)
        assert [d.total_mib for d in devices] == [4096] and reason == ""
        assert threads and threads[0].startswith("device-probe")
    finally:
        gate.set()
        await asyncio.gather(*blocked)
        probe.close()


async def test_heartbeats_keep_their_interval_while_an_engine_never_answers(stack, nc, agents):
    """Its load polls (30 s timeout) and the rollout's checks all hang on the engine; the heartbeats do not."""
    engine = Hanging()
    try:
        agents.start(
            "n1",
            gpus="4096",
            extra=(
                "--engine",
                f"vllm={engine.url}",
                "--engine-model",
                "tiny",
                "--engine-yield",
                "compute,poll=0.05,timeout=30",
                "--engine-check-interval",
                "0.2",
            ),
        )
        await wait_nodes(nc, 1)
        await wait_for(lambda: len(engine.conns) >= 2, timeout=20, what="the agent's calls to the hanging engine")
        # the heartbeats as the agent sent them (its own sent_at), not as this process's scheduler heard them: on a
        # busy machine this process can stall past the 0.75 s window, which the agent's loop is not what broke
        seen: list[float] = []

        async def heard(msg) -> None:
            seen.append(msgspec.json.decode(msg.data, type=Heartbeat).sent_at)

        sub = await nc.subscribe(names.node("n1").heartbeat, cb=heard)
        try:
            await wait_for(lambda: seen and seen[-1] - seen[0] >= 3.0, timeout=10, what="3 s of heartbeats")
        finally:
            await sub.unsubscribe()
        gaps = [b - a for a, b in zip(seen, seen[1:])]
        assert len(seen) >= 6 and max(gaps) < 0.75, (len(seen), gaps)  # every 0.25 s; gone after 3 missed
        assert agents.terminate("n1") == 0
        assert "Unclosed client session" not in agents.log("n1"), agents.log("n1")[-2000:]
    finally:
        engine.close()
