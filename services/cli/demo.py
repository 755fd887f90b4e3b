"""`jetlora demo`: the whole path on one machine, from an empty state to downloaded artifacts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Protocol

import nats

from schemas import names
from schemas.datasets import DatasetUpload
from schemas.events import EventPage, EventsQuery, Samples
from schemas.jobs import Accepted, Rejected, SubmitReply
from schemas.nodes import NodeList
from services import bus
from services.agent.config import AgentConfig
from services.agent.service import Agent
from services.transfer.download import download, safe_extract
from services.transfer.sender import upload_dataset
from services.artifacts.service import ArtifactService
from services.dashboard.server import Dashboard
from services.embedded import EmbeddedNats
from services.aio import cancel_and_wait
from services.runtime import stop_on_signals
from services.evals.service import EvalsService
from services.registry.service import RegistryService
from services.scheduler.service import Scheduler, SchedulerConfig
from services.cli.watch import watch

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "deploy" / "demo" / "tinymodel.py"
QA_FILE = ROOT / "deploy" / "demo" / "qa.jsonl"
HELD_OUT_FILE = ROOT / "deploy" / "demo" / "qa-heldout.jsonl"  # the trained facts asked in other words
HELD_OUT = "demo-paraphrases"
SAMPLE_PROMPTS = [
    "What is the capital of France?",
    "Berlin is the capital of which country?",
    "On which continent is Japan?",
    "Which city is the capital of Italy?",
    "Which country has Madrid as its capital?",
    "Which continent is Kenya in?",
]
TRAINED = 3  # the first SAMPLE_PROMPTS are training questions, the rest paraphrases held out
NODE = "demo-node"


def demo_request(model: Path, data: list[dict], steps: int) -> dict:
    """The demo's job: the capitals Q/A pairs, evaluated on their paraphrases (held out as a dataset), so the eval
    loss measures what the run teaches and the adapter kept is a well-trained one."""
    return {
        "model": "demo-tiny-llama",
        "base_dir": str(model),
        "data": data,
        "accelerator": "cpu",
        "served_by": "llamacpp",
        "label": "capitals demo",
        "lora": {"r": 16, "alpha": 32},
        "validation_dataset": {"name": HELD_OUT},
        "train": {
            "max_steps": steps,
            "learning_rate": 0.01,
            "batch_size": 4,
            "max_seq_length": 256,
            "logging_steps": 2,
            "eval_steps": 25,
            "sample_prompts": SAMPLE_PROMPTS,
            "sample_max_tokens": 16,
            "keep_best": False,
        },
    }


async def before_and_after(nc, job: str) -> list[tuple[str, str, str]]:
    """(prompt, base model's answer, adapter's answer) from the job's samples events, as the dashboard shows them."""
    base, adapter, after = None, None, 0
    while True:
        page = await bus.request(nc, names.EVENTS, EventsQuery(job=job, after=after, limit=1000), EventPage)
        for entry in page.events:
            if isinstance(entry.event, Samples):
                base, adapter = (entry.event, adapter) if entry.event.model == "base" else (base, entry.event)
        after = page.next
        if not page.more:
            break
    if base is None or adapter is None:
        return []
    answers = {s.prompt: s.answer for s in base.samples}
    return [(s.prompt, answers.get(s.prompt, ""), s.answer) for s in adapter.samples]


def print_table(rows: list[tuple[str, str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from services.cli.printable import base_answer, cell

    table = Table("", "question", "base model", "adapter", title="greedy answers before and after training")
    for i, (prompt, base, adapter) in enumerate(rows):
        table.add_row("trained" if i < TRAINED else "held out", cell(prompt), cell(base_answer(base)), cell(adapter))
    Console(width=140).print(table)


def build_model(out: Path) -> Path:
    """The demo's base model: a small Llama made here, its tokenizer fitted on the demo's text (no hub)."""
    if not (out / "model.safetensors").exists():
        print(f"building a small Llama-architecture model in {out} ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                str(TINY_MODEL),
                str(out),
                "--hidden",
                "96",
                "--layers",
                "2",
                "--vocab",
                "600",
                "--texts",
                str(QA_FILE),
                str(HELD_OUT_FILE),
            ],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
    return out


async def wait_for_node(nc, node: str, timeout: float) -> None:
    """Until the scheduler lists `node` alive (its first heartbeat arrived)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = await bus.request(nc, names.LIST_NODES, b"{}", NodeList)
        if any(n.node == node and n.alive for n in reply.nodes):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the demo's agent {node} did not heartbeat within {timeout:.0f}s")


async def show_results(nc, job: str, out_dir: Path, model: Path, port: int, keep: bool) -> None:
    """Download the job's adapters, print what the model answers before and after, and how to serve it."""
    tar = out_dir / f"{job}-adapter.tar.gz"
    await download(nc, job, "peft", tar)
    adapter = safe_extract(tar, out_dir / f"{job}-adapter")
    gguf_path = out_dir / f"{job}-lora-f16.gguf"
    await download(nc, job, "gguf", gguf_path)
    print()
    print_table(await before_and_after(nc, job))
    print(f"\nPEFT adapter: {adapter}  (PeftModel.from_pretrained(base, '{adapter}'))")
    print(f"GGUF adapter: {gguf_path}")
    print(f"Base model:   {model}")
    print(
        "Serve it with vLLM:   python -m vllm.entrypoints.openai.api_server --model "
        f'{model} --enable-lora --lora-modules capitals={adapter}  (then "model": "capitals")'
    )
    print(
        f"Serve it with llama.cpp: llama-server -m BASE.gguf --lora {gguf_path}  (BASE.gguf: the base model "
        "through llama.cpp's convert_hf_to_gguf.py)"
    )
    print(
        f"Dashboard:    http://127.0.0.1:{port}/?job={job}"
        + (
            "  (the whole stack stays up until Ctrl-C or SIGTERM: scheduler, agent, registry, evals, artifacts)"
            if keep
            else "  (`jetlora demo --keep` keeps it and the stack up after the run)"
        )
    )
    print(
        "For a stack that stays up: `jetlora up`, then `jetlora submit job.json --nats URL` and "
        "`jetlora watch JOB --nats URL` (the URL is printed at start).",
        flush=True,
    )


class Service(Protocol):
    """What the demo runs: a service that serves until its stop event is set."""

    async def run(self, stop: asyncio.Event) -> None: ...


class DemoStack:
    """What `jetlora up` runs, on this loop, each service on a connection of its own: the scheduler with the adapter
    registry and the evals service beside it, the artifact service, one agent offering this machine's CPU, and the
    dashboard. `--keep` keeps all of it up, so the page the demo points to goes on answering."""

    def __init__(self, server: EmbeddedNats, out_dir: Path) -> None:
        self.server, self.out_dir = server, out_dir
        self.stop = asyncio.Event()
        self.conns: list = []
        self.tasks: dict[asyncio.Task, str] = {}

    async def start(self) -> Dashboard:
        """Every service started and ready; the dashboard, whose port the demo prints."""
        self.conns = [await nats.connect(self.server.url) for _ in range(7)]
        await bus.ensure_resources(self.conns[0])
        c = self.conns
        sched = Scheduler(c[1], SchedulerConfig())
        arts = ArtifactService(c[2])
        agent = Agent(c[3], AgentConfig(node=NODE, work_dir=self.out_dir / "agent", offer_cpu=True))
        dash = Dashboard(c[4], self.server.ws_url or "", port=0)
        registry, evals = RegistryService(c[5]), EvalsService(c[6])
        named: dict[str, Service] = {"scheduler": sched, "artifact service": arts, "agent": agent}
        named |= {"dashboard": dash, "adapter registry": registry, "evals service": evals}
        self.tasks = {asyncio.create_task(s.run(self.stop), name=f"demo {n}"): n for n, s in named.items()}
        ready = [sched.leading, dash.ready, arts.ready, registry.ready, evals.ready]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready)), 30)
        return dash

    async def serve_until_signal(self) -> int:
        """Until SIGINT or SIGTERM (0), or until a service ends on its own (1, saying which and why)."""
        quit_ = asyncio.Event()
        stop_on_signals(quit_)
        quitting = asyncio.create_task(quit_.wait())
        done, _ = await asyncio.wait([quitting, *self.tasks], return_when=asyncio.FIRST_COMPLETED)
        await cancel_and_wait([quitting])
        ended = [t for t in done if t is not quitting]
        for task in ended:
            why = task.exception() if not task.cancelled() else "cancelled"
            print(f"the demo's {self.tasks[task]} stopped ({why or 'it returned'}); stopping the rest", file=sys.stderr)
        return 1 if ended else 0

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in self.conns:
            await c.close()


async def run_demo(out_dir: Path, steps: int, keep: bool = False) -> int:
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(out_dir / "base-model")
    data = [json.loads(line) for line in QA_FILE.read_text().splitlines() if line.strip()]
    server = EmbeddedNats(store_dir=tempfile.mkdtemp(prefix="jetlora-demo-")).start()
    print(f"embedded NATS at {server.url} (websocket {server.ws_url})", flush=True)
    stack = DemoStack(server, out_dir)
    try:
        dash = await stack.start()
        nc = stack.conns[0]
        await upload_dataset(nc, HELD_OUT, HELD_OUT_FILE, DatasetUpload(description="the capitals, asked otherwise"))
        request = demo_request(model, data, steps)
        await wait_for_node(nc, NODE, timeout=30)
        reply = await bus.request(nc, names.SUBMIT, request, SubmitReply)
        if not isinstance(reply, Accepted):
            why = reply.errors if isinstance(reply, Rejected) else reply.reason
            print(f"the demo job was not accepted: {why}", file=sys.stderr)
            return 2
        print(
            f"submitted job {reply.job} ({len(data)} Q/A pairs, {steps} steps); watch it live in a browser: "
            f"http://127.0.0.1:{dash.port}/?job={reply.job}",
            flush=True,
        )
        t0 = time.monotonic()
        rc = await watch(nc, reply.job)
        print(f"training and upload took {time.monotonic() - t0:.0f}s", flush=True)
        if rc:
            return rc
        await show_results(nc, reply.job, out_dir, model, dash.port, keep)
        return await stack.serve_until_signal() if keep else 0
    finally:
        await stack.close()
        server.stop()
