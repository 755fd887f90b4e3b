"""The dashboard's panels in a real headless Chromium, on the real stack (nats-server, scheduler with co-training,
artifact service, registry, evals service, the gateway's Tinker API, three agents as processes, each offering its
CPU, with the real trainer and the tiny local model): two jobs co-trained in one group, one of which registers
through a gate (whose eval runs take the devices as they free); a grpo job; a Tinker session with a few calls. Each
panel shows them: the group's members on the CPU device, the reward curve with its pass rate, the session's calls
and state, the version's eval scores and the gate's decision; and the page says nothing is wrong.

The tenants panel on a fair-shared fleet (the stand-in trainer on four simulated devices): two tenants holding
devices, each one's weight, nominal, borrow limit, fair share, in use and borrowed as the scheduler answers them, and
the job a preemption checkpointed marked in the job list with who preempted it and why."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest

from schemas import names
from schemas.evals import Criterion, EvalCreate, EvalReply
from schemas.jobs import Accepted, Error
from schemas.tenants import TenantList, TenantShare, TenantsQuery
from services import bus
from services.dashboard.server import Dashboard
from services.evals.service import EvalsService
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.scheduler.config import TenantQuota
from services.scheduler.core import SchedulerConfig
from services.transfer.sender import upload_dataset
from tests.conftest import get_job, submit, wait_for, wait_nodes, wait_state
from tests.qa import QA_PAIRS, pairs
from tests.test_dashboard import CHROMIUM, FLAGS, needs_browser
from tests.test_dataset_formats import data_file
from tests.test_tinker_api import client, datums, key_for

pytestmark = [needs_browser, pytest.mark.timeout(180)]
os.environ.setdefault("TINKER_TELEMETRY", "0")
SAYS_ANSWER = {
    "type": "string_check",
    "name": "says_answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "ilike",
}
SFT = {"learning_rate": 0.01, "batch_size": 1, "max_seq_length": 96, "warmup_steps": 0, "logging_steps": 2}
QUESTIONS = QA_PAIRS[:4]
SAMPLED = {"eval_fraction": 0.25, "eval_steps": 8, "sample_prompts": [QUESTIONS[0][0]], "sample_max_tokens": 8}


def rft_rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}], "answer": a} for q, a in QUESTIONS]


@pytest.fixture
async def gateway(nc, tiny_model):
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0)
    await gw.start()
    yield gw
    await gw.close()


async def start_stack(services, nats_server) -> Dashboard:
    """What `jetlora up` runs besides the agent and the gateway, in this process, with co-training on."""
    from services.artifacts.service import ArtifactService
    from services.registry.service import RegistryService
    from services.scheduler.service import Scheduler

    config = SchedulerConfig(co_train="same-tenant", heartbeat_interval=0.25, misses=8)
    sched, *_ = await services.start(lambda c: Scheduler(c, config))
    await services.start(lambda c: ArtifactService(c))
    await services.start(lambda c: RegistryService(c))
    evals, *_ = await services.start(lambda c: EvalsService(c))
    dash, *_ = await services.start(lambda c: Dashboard(c, nats_server.ws_url, port=0))
    for ready in (sched.leading, evals.ready, dash.ready):
        await asyncio.wait_for(ready.wait(), 15)
    return dash


async def queue_work(nc, tiny_model, tmp_path) -> dict[str, str]:
    """An eval to gate by; two sft jobs of one tenant to train in one group (the shorter registers through the
    gate); a grpo job. All queued before any node comes, so the two are placed together."""
    await upload_dataset(nc, "qa-rft", data_file(tmp_path / "rft.jsonl", "rft", rft_rows()).path)
    create = EvalCreate(name="qa", dataset="qa-rft", criteria=[msgspec.convert({"grader": SAYS_ANSWER}, Criterion)])
    create.sampling.max_tokens = 8
    assert isinstance(await bus.request(nc, names.evals_api().create, create, EvalReply | Error), EvalReply)
    base = {"model": "tiny", "base_dir": str(tiny_model), "accelerator": "cpu"}
    gate = {"name": "capitals", "promote": True, "gate": {"eval": "qa", "margin": -1.0}}
    requests = {
        "short": {
            **base,
            "data": pairs(),
            "label": "gated",
            "train": {**SFT, **SAMPLED, "max_steps": 16},
            "register": gate,
        },
        "long": {**base, "data": pairs(), "label": "beside it", "train": {**SFT, "max_steps": 40}},
        "grpo": {
            **base,
            "dataset": {"name": "qa-rft"},
            "label": "rewarded",
            "train": {
                "method": "grpo",
                "grader": SAYS_ANSWER,
                "batch_size": 2,
                "group_size": 4,
                "max_completion_tokens": 8,
                "max_steps": 6,
                "logging_steps": 1,
                "max_seq_length": 96,
                "learning_rate": 0.005,
            },
        },
    }
    ids = {}
    for name, request in requests.items():
        reply = await submit(nc, request)
        assert isinstance(reply, Accepted), (name, reply)
        ids[name] = reply.job
    return ids


class TinkerSession:
    """A Tinker training session with a few calls, driven by the official client (in a thread: it blocks)."""

    def __init__(self, gateway, key: str) -> None:
        from tinker import types

        self.sc = client(gateway, key)
        self.tc = self.sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        batch, _ = datums(self.tc.get_tokenizer(), types)
        self.tc.forward_backward(batch[:2], "cross_entropy").result()
        self.tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        self.model_id: str = self.tc.model_id
        self.session = self.model_id.split(":", 1)[0]


async def gate_decided(nc) -> str:
    from schemas.registry import AdapterQuery, AdapterReply

    reply = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name="capitals"), AdapterReply | Error)
    return reply.alias.last_gate if isinstance(reply, AdapterReply) and reply.alias.gate is None else ""


def text_of(selector: str) -> str:
    return f"(document.querySelector({selector!r}) || {{textContent: ''}}).textContent"


async def shows(page, selector: str, *texts: str, timeout: float = 60) -> str:
    """The element's text once it shows every one of `texts` (the test fails with what it showed instead)."""
    condition = " && ".join(f"{text_of(selector)}.includes({t!r})" for t in texts)
    try:
        await page.wait_for_function(condition, timeout=timeout * 1000)
    except Exception:
        raise AssertionError(f"{selector} never showed {texts}: {await page.text_content(selector)!r}") from None
    return await page.text_content(selector) or ""


async def test_every_panel_shows_what_runs(services, nc, nats_server, gateway, agents, tiny_model, tmp_path):
    from playwright.async_api import async_playwright

    started = time.monotonic()
    dash = await start_stack(services, nats_server)
    ids = await queue_work(nc, tiny_model, tmp_path)
    for node in ("box-1", "box-2", "box-3"):  # a device runs one job, or one group, at a time
        agents.start(node, gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 3)
    tinker = await asyncio.to_thread(TinkerSession, gateway, await key_for(nc, "acme"))

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = await browser.new_page(viewport={"width": 1500, "height": 1200})

        def mark(what: str) -> None:
            print(f"{time.monotonic() - started:5.1f}s {what}")

        await page.goto(f"http://127.0.0.1:{dash.port}/?job={ids['short']}")
        # the Tinker session: active, its model's job, its calls; then its client ends it
        sessions = await shows(
            page, "#sessions", tinker.session, "active", "forward_backward cross_entropy", "optim_step"
        )
        assert tinker.model_id in sessions and "acme" in sessions and "3 calls" in sessions, sessions
        await asyncio.to_thread(tinker.sc.close, "success")
        mark("the Tinker session")
        # the node: its CPU named as a person names it, under a state column with a heading
        await shows(page, "#nodes", "box-1", "box-2", "box-3", "up")
        devices = await page.evaluate("[...document.querySelectorAll('#nodes tr')].map(r => r.cells[2].textContent)")
        assert devices and all(d.startswith("CPU (") for d in devices), devices  # not "-1 CPU (2 cores)"
        headings = await page.evaluate(
            "[...document.querySelectorAll('#nodes')[0].closest('table').tHead.rows[0].cells].map(c => c.textContent)"
        )
        assert "" not in headings and "state" in headings, headings
        mark("the nodes")
        # the co-training group: both members, on the node's CPU
        groups = await shows(page, "#groups", ids["short"], ids["long"])
        assert "CPU (" in groups and "box-" in groups, groups
        assert await page.evaluate("window.jetlora.groups.some(g => g.members.length === 2)")
        mark("the co-training group")
        # the grpo job's rewards: its row, and the curve with its pass rate drawn from its progress events
        rewards = await shows(page, "#rewards", ids["grpo"], "%")
        assert "rewarded" in rewards, rewards
        await page.wait_for_function(
            "window.jetlora.rlChart && window.jetlora.rlChart.data.datasets[0].data.length > 0"
            " && window.jetlora.rlChart.data.datasets[2].data.length > 0",
            timeout=30_000,
        )
        mark("the rewards")
        # the gated version: its eval scores (grader, interval, pass rate) and the gate's decision
        decision = await wait_for(lambda: gate_decided(nc), timeout=120, interval=0.5, what="the gate's decision")
        await shows(page, "#adapters", "capitals", decision[:40])
        runs = await shows(page, "#runs", "capitals@1", "says_answer", "pass")
        assert "tiny (base)" in runs, runs  # what a first version is gated against
        mark("the gate and its eval runs")
        # the chosen job's samples: the base model's answer readable, or said to be none
        await shows(page, "#samples", "base model")
        base_answers = await page.evaluate(
            "[...document.querySelectorAll('#samples tr')].slice(1).map(r => r.cells[1].textContent)"
        )
        assert base_answers and all("\ufffd" not in a for a in base_answers), base_answers
        # no source failed to answer (one that timed out once on a busy machine is cleared by its next answer)
        await shows(page, "#status", "connected")
        await page.wait_for_function(f"!{text_of('#status')}.includes('·')", timeout=15_000)
        await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        await browser.close()
    print(f"\nevery panel shown {time.monotonic() - started:.1f}s after the stack started")
    print(await dash.tinker.panel())


HELD = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), "gpu_mib": 1000}  # the stand-in trainer's
SHARED = {"acme": "weight:2,devices:1", "globex": "weight:1,borrow:2"}  # --quota, as an operator gives them


def tenant_rows_js() -> str:
    """The tenants table as the page shows it: tenant -> its cells' texts."""
    return (
        "Object.fromEntries([...document.querySelectorAll('#tenants tr[data-tenant]')]"
        ".map(r => [r.dataset.tenant, [...r.cells].map(c => c.textContent.trim())]))"
    )


def as_shown(share: TenantShare) -> list[str]:
    """What the tenants table should show of one tenant's share (weight, nominal, borrow limit, fair share, in use
    of fair share, borrowed, waiting), from the scheduler's own answer."""
    limit = "no limit" if share.borrow_limit is None else str(share.borrow_limit)
    waiting = "–"
    if share.queued:
        waiting = f"{share.queued} job{'s' if share.queued != 1 else ''} ({share.wanted} device{'s' if share.wanted != 1 else ''})"
    weight = f"{share.weight:g}"
    used = f"{share.in_use} of {share.fair_share}"
    return [
        str(share.tenant),
        weight,
        str(share.nominal),
        limit,
        str(share.fair_share),
        used,
        str(share.borrowed),
        waiting,
    ]


async def test_the_tenants_panel_shows_each_tenants_share_and_the_jobs_preempted(
    services, nc, nats_server, agents, tmp_path
):
    """acme (weight 2, one nominal device) fills the four devices; globex (weight 1) comes: one of acme's jobs is
    checkpointed for it. The page shows both tenants' shares as the scheduler answers them, the sharing mode, a bar
    of in use against fair share, and the preempted job marked with who preempted it and why."""
    from playwright.async_api import async_playwright

    from services.artifacts.service import ArtifactService
    from services.registry.service import RegistryService
    from services.scheduler.service import Scheduler

    quotas = {tenant: TenantQuota.parse(text) for tenant, text in SHARED.items()}
    config = SchedulerConfig(co_train="off", heartbeat_interval=0.25, misses=4, min_run_s=1.0, quotas=quotas)
    sched, *_ = await services.start(lambda c: Scheduler(c, config))
    await services.start(lambda c: ArtifactService(c))
    await services.start(lambda c: RegistryService(c))
    evals, *_ = await services.start(lambda c: EvalsService(c))
    dash, *_ = await services.start(lambda c: Dashboard(c, nats_server.ws_url, port=0))
    for ready in (sched.leading, evals.ready, dash.ready):
        await asyncio.wait_for(ready.wait(), 15)
    agents.start("n1", gpus="4096,4096,4096,4096", hold_s=120, env={"HOLD_STEPS": "120"})  # a step a second
    await wait_nodes(nc, 1)
    acme = [await submit_as(nc, "acme", label=f"acme-{i}") for i in range(4)]
    for job in acme:
        await wait_state(nc, job, "running", timeout=30)

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = await browser.new_page(viewport={"width": 1500, "height": 1100})
        await page.goto(f"http://127.0.0.1:{dash.port}/")
        # acme alone borrows the whole fleet: its share is all four, three beyond its one nominal device
        mode = await shows(page, "#tenants-mode", "sharing fair", "4 devices")
        assert "admins' jobs placed before the tenants'" in mode, mode
        await shows_shares(page, nc, {"acme": (4, 4), "globex": (0, 0)})  # globex: a quota, no jobs yet

        globex = [await submit_as(nc, "globex", label=f"globex-{i}") for i in range(2)]
        await wait_state(nc, globex[0], "running", timeout=20)  # one of acme's checkpointed for it
        rows = await shows_shares(page, nc, {"acme": (3, 3), "globex": (1, 1)})
        assert rows["acme"][1:4] == ["2", "1", "no limit"] and rows["globex"][1:4] == ["1", "0", "2"], rows
        assert rows["acme"][6] == "2" and rows["globex"][6] == "1", rows  # borrowed beyond nominal
        assert rows["globex"][7] == "1 job (1 device)", rows  # its second waits: its share is one
        # each bar: in use up to the share, nothing beyond it, the share's tick at its place on the fleet
        bars = await page.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#tenants tr[data-tenant]')].map(r => [r.dataset.tenant,"
            " ['within', 'over', 'fair'].map(k => r.querySelector('.share-bar .' + k).style[k === 'fair' ? 'left' : 'width'])]))"
        )
        assert bars == {"acme": ["75%", "0%", "75%"], "globex": ["25%", "0%", "25%"]}, bars

        preempted = [j for j in acme if (await get_job(nc, j)).preempted]
        assert len(preempted) == 1, [await get_job(nc, j) for j in acme]
        why = (await get_job(nc, preempted[0])).preempted
        assert why.startswith("preempted: tenant globex below its fair share"), why
        row = f"#jobs tr[data-job={preempted[0]!r}]"
        await shows(page, row, "preempted", why, timeout=20)
        marked = await page.evaluate(
            "[...document.querySelectorAll('#jobs tr.was-preempted')]"
            ".map(r => [r.dataset.job, r.querySelector('.preempted').title])"
        )
        assert marked == [[preempted[0], why]], marked
        cells = await page.evaluate(f"[...document.querySelector({row!r}).cells].map(c => c.textContent)")
        assert cells[1] == "acme" and cells[2] == "queued preempted", cells
        await page.wait_for_function(f"!{text_of('#status')}.includes('·')", timeout=15_000)  # nothing failed
        await page.screenshot(path=str(tmp_path / "tenants.png"), full_page=True)
        await browser.close()


async def submit_as(nc, tenant: str, **job) -> str:
    return (await bus.request(nc, names.jobs_api(tenant).submit, {**HELD, **job}, Accepted)).job


async def shows_shares(page, nc, wanted: dict[str, tuple[int, int]], timeout: float = 30) -> dict[str, list[str]]:
    """Until the scheduler's shares are `wanted` (tenant -> fair share, in use) and the page shows exactly what the
    scheduler answers for each tenant; the rows as shown."""
    deadline = time.monotonic() + timeout
    expected: dict[str, list[str]] = {}
    shown: dict[str, list[str]] = {}
    while time.monotonic() < deadline:
        answer = await bus.request(nc, names.TENANTS, TenantsQuery(), TenantList)
        expected = {t.tenant or "admins": as_shown(t) for t in answer.tenants}
        shown = await page.evaluate(tenant_rows_js())
        shares = {t.tenant or "admins": (t.fair_share, t.in_use) for t in answer.tenants}
        if shares == wanted and shown == expected:
            return shown
        await asyncio.sleep(0.2)
    raise AssertionError(f"the tenants panel showed {shown}, the scheduler answered {expected}, wanted {wanted}")
