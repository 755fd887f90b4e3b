"""The dashboard in a real headless Chromium: a job's loss curve grows while it trains, replayed from its start."""

from __future__ import annotations

import asyncio
import gzip
import importlib.util
import shutil
import urllib.request

import msgspec
import pytest

from schemas import names
from schemas.jobs import Accepted
from schemas.job_status import JobQuery, JobReply
from services import bus
from services.artifacts.service import ArtifactService
from services.dashboard.server import Dashboard
from services.registry.service import RegistryService
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import get_job, submit, wait_for, wait_state
from tests.qa import pairs

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_BROWSER = (
    "needs Debian's chromium (deploy/setup.sh installs it)"
    if CHROMIUM is None
    else "needs playwright (the test extras: pip install -e '.[test]')"
    if importlib.util.find_spec("playwright") is None
    else ""
)
needs_browser = pytest.mark.skipif(bool(NO_BROWSER), reason=NO_BROWSER)
pytestmark = needs_browser
FLAGS = [  # headless as root, and none of Chromium's own calls out (a closed network refuses them, many at a time)
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


SAMPLE_PROMPT = "What is the capital of France?"


async def promoted_with_a_node_status(nc) -> None:
    from schemas.registry import AdapterVersion, NodeAdapterStatus, Smoke, StoredFile
    from services.registry.store import AdapterRegistry

    registry = AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))
    await registry.add_version(
        AdapterVersion(
            name="capitals",
            version=1,
            job="j1",
            base_model="tiny",
            r=8,
            alpha=16,
            peft=StoredFile(name="j1/peft", sha256="0" * 64, size=1),
            target_modules=["q_proj"],
        )
    )
    await registry.change_alias("capitals", lambda a: msgspec.structs.replace(a, current=1), expect=None)
    await registry.put_node_status(
        NodeAdapterStatus(
            name="capitals",
            version=1,
            node="edge-1",
            engine="vllm-dir /x",
            state="loaded",
            smoke=Smoke(latency_ms=12.0, text="Paris"),
        )
    )


async def _stepped(nc, job_id: str, steps: int):
    return (await get_job(nc, job_id)).step >= steps


async def test_the_loss_curve_grows_while_the_job_trains(nc, services, agents, tiny_model, nats_server):
    from playwright.async_api import async_playwright

    sched, *_ = await services.start(lambda c: Scheduler(c, SchedulerConfig(co_train="off", heartbeat_interval=0.5)))
    await services.start(lambda c: ArtifactService(c))
    dash, *_ = await services.start(lambda c: Dashboard(c, nats_server.ws_url, port=0))
    await services.start(lambda c: RegistryService(c))
    await promoted_with_a_node_status(nc)
    await asyncio.wait_for(sched.leading.wait(), 10)
    await asyncio.wait_for(dash.ready.wait(), 10)
    agents.start("cpu-node", gpus=None, offer_cpu=True, trainer=None, interval=0.5)
    reply = await submit(
        nc,
        {
            "model": "tiny",
            "base_dir": str(tiny_model),
            "data": pairs(),
            "accelerator": "cpu",
            "label": "browser",
            "train": {
                "max_steps": 20000,
                "learning_rate": 0.005,
                "batch_size": 1,
                "max_seq_length": 128,
                "eval_fraction": 0.25,
                "eval_steps": 5,
                "sample_prompts": [SAMPLE_PROMPT],
                "sample_max_tokens": 8,
            },
        },
    )
    assert isinstance(reply, Accepted)
    job = reply.job
    await wait_state(nc, job, "running", timeout=60)
    await wait_for(lambda: _stepped(nc, job, 3), timeout=60, what="a few steps before the page opens")  # to replay
    base = f"http://127.0.0.1:{dash.port}"
    page_html = await asyncio.to_thread(lambda: urllib.request.urlopen(base + "/", timeout=5).read().decode())
    assert '<script src="app.js">' in page_html

    def fetch_app(encoding):
        req = urllib.request.Request(base + "/app.js", headers={"Accept-Encoding": encoding} if encoding else {})
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.headers.get("Content-Encoding"), r.read()

    plain_enc, plain = await asyncio.to_thread(fetch_app, None)
    gz_enc, packed = await asyncio.to_thread(fetch_app, "gzip, deflate")
    assert plain_enc is None and b"wsconnect" in plain  # old clients get it inflated
    assert gz_enc == "gzip" and gzip.decompress(packed) == plain and len(packed) < len(plain) / 2

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = await browser.new_page()
        await page.goto(f"{base}/?job={job}")
        await page.wait_for_function("window.jetlora && window.jetlora.points.length > 5", timeout=30_000)
        first = await page.evaluate("window.jetlora.points.map(p => p.x)")
        assert first[0] == 1  # replayed from the first step, though the page opened mid-run
        await page.wait_for_function(f"window.jetlora.points.length > {len(first)}", timeout=60_000)  # it follows
        later = await page.evaluate("window.jetlora.points.length")
        drawn = await page.evaluate("window.jetlora.chart.data.datasets.map(d => d.data.length)")
        assert drawn[0] >= later and drawn[1] == drawn[0]  # raw points and their moving average are plotted
        await page.wait_for_function(
            "document.querySelector('#nodes').textContent.includes('cpu-node')", timeout=10_000
        )
        await page.wait_for_function(f"document.querySelector('#jobs').textContent.includes('{job}')", timeout=10_000)
        assert "tok/s" in await page.text_content("#figures") and "peak" in await page.text_content("#figures")
        # beside the chart: the base model's answer and the adapter's latest, to the job's sample prompt
        await page.wait_for_function(
            "document.querySelector('#samples').textContent.includes('(step ')", timeout=60_000
        )
        rows = await page.evaluate(
            "[...document.querySelectorAll('#samples tr')].map(r => [...r.cells].map(c => c.textContent))"
        )
        assert rows[0][:2] == ["prompt", "base model"] and rows[1][0] == SAMPLE_PROMPT
        assert rows[1][1] not in ("", "–") and rows[1][2] not in ("", "–")
        # the registry: what each adapter serves and what every node's engine did with it
        await page.wait_for_function(
            "document.querySelector('#adapters').textContent.includes('edge-1: @1 loaded')", timeout=10_000
        )
        await browser.close()
    await bus.request(nc, names.CANCEL, JobQuery(job), JobReply)
    await wait_state(nc, job, "cancelled", timeout=20)
