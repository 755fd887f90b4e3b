"""A real engine: a trained adapter goes live in a llama.cpp server (llama-cpp-python's OpenAI-compatible server)
through the registry. The agent starts the server with the base GGUF (through the operator's restart command),
then places the adapter's GGUF and runs that command again, because llama-server opens adapter files only at
start; the completion then differs from the base model's.

Needs `pip install -e .[llamacpp]` (llama-cpp-python with its server; a build of about 7 minutes) and a llama.cpp
checkout for the base-model converter (LLAMA_CPP_DIR; llama-cpp-python's sdist vendors one)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from schemas import names
from schemas.jobs import Accepted
from schemas.registry import AdapterReply, AliasRequest, RegisterRequest
from services import bus
from services.embedded import free_port
from tests.conftest import ROOT, get_job, list_nodes, submit, wait_for, wait_state
from tests.qa import pairs
from tests.test_registry import serving, show

LLAMA_CPP_DIR = os.environ.get("LLAMA_CPP_DIR", "")
MISSING = [
    why
    for missing, why in (
        (
            importlib.util.find_spec("llama_cpp") is None,
            "llama-cpp-python is not installed (pip install -e .[llamacpp])",
        ),
        (
            importlib.util.find_spec("starlette") is None,
            "llama-cpp-python's server extra is not installed (pip install -e .[llamacpp])",
        ),
        (
            not (Path(LLAMA_CPP_DIR) / "convert_hf_to_gguf.py").is_file(),
            "LLAMA_CPP_DIR does not name a llama.cpp checkout with convert_hf_to_gguf.py",
        ),
    )
    if missing
]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))
PROMPT = "What is the capital of France?"


def completion(url: str) -> tuple[str, list]:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        choice = json.load(r)["choices"][0]
    return choice["text"], choice["logprobs"]["top_logprobs"]


async def answers(url: str) -> bool:
    def ask():
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=1):
                return True
        except OSError:
            return False

    return await asyncio.to_thread(ask)


async def trainer_known(nc) -> bool:
    return any(n.node == "trainer" and n.offers_cpu for n in await list_nodes(nc))


async def test_a_promoted_adapter_goes_live_in_a_llama_cpp_server(stack, nc, agents, tiny_model, tmp_path):
    base = tmp_path / "base.gguf"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "programs" / "convert_base.py"),
            LLAMA_CPP_DIR,
            str(tiny_model),
            str(base),
        ],
        check=True,
        capture_output=True,
    )
    port, pid_file = free_port(), tmp_path / "llama-server.pid"
    restart = f"{sys.executable} {ROOT / 'tests' / 'programs' / 'llama_server.py'} {base} {port} {pid_file}"
    url = f"http://127.0.0.1:{port}"
    try:
        agents.start(
            "edge",
            gpus=None,
            extra=(
                "--engine",
                f"llamacpp={tmp_path / 'adapters'},{url}",
                "--engine-model",
                "tiny",
                "--engine-restart",
                restart,
            ),
        )
        await wait_for(lambda: answers(url), timeout=90, what="the agent to start llama-server with the base model")
        base_text, base_logprobs = completion(url)
        agents.start("trainer", gpus=None, offer_cpu=True, trainer=None)
        await wait_for(lambda: trainer_known(nc), timeout=30, what="the training node")
        reply = await submit(
            nc,
            {
                "model": "tiny",
                "base_dir": str(tiny_model),
                "data": pairs(),
                "accelerator": "cpu",
                "served_by": "llamacpp",
                "register": {"name": "capitals", "promote": True},
                "train": {"max_steps": 40, "learning_rate": 0.01, "batch_size": 1, "max_seq_length": 128},
            },
        )
        assert isinstance(reply, Accepted), reply
        job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=120)
        assert job.state == "succeeded", job.message

        async def registered() -> bool:  # the scheduler registers it once the job has succeeded, and says so
            return "registered as capitals@1 and promoted" in (await get_job(nc, reply.job)).message

        await wait_for(registered, timeout=30, what="the job's registration")
        await serving(nc, "capitals", {"edge": (1, "loaded")})
        [status] = (await show(nc, "capitals")).nodes
        assert "restarted llama-server" in status.message and status.smoke and status.smoke.latency_ms > 0
        text, logprobs = completion(url)
        moved = max(abs(a[t] - b.get(t, -100.0)) for a, b in zip(logprobs, base_logprobs) for t in a)
        print(
            f"base: {base_text!r}; with capitals@1: {text!r} (smoke {status.smoke.latency_ms:.0f} ms: "
            f"{status.smoke.text!r}); largest top-logprob change {moved:.2f}"
        )
        assert text != base_text or moved > 0.1
        assert status.state == "loaded" and "answers its probe" in status.message, status.message

        # a second name for the same llama-server is refused: llama-server would apply both adapters to every request
        await bus.request(
            nc, names.ADAPTERS.register, RegisterRequest(name="capitals-alt", job=reply.job, promote=True), AdapterReply
        )
        await serving(nc, "capitals-alt", {"edge": (1, "failed")})
        [alt] = (await show(nc, "capitals-alt")).nodes
        assert "serves capitals already" in alt.message, alt.message
        assert completion(url)[0] == text  # still capitals alone

        # retire: the file goes and llama-server is restarted without it, so it answers as the base model again
        await bus.request(nc, names.ADAPTERS.retire, AliasRequest(name="capitals"), AdapterReply)
        await serving(nc, "capitals", {"edge": (1, "unloaded")})
        [retired] = (await show(nc, "capitals")).nodes
        assert "restarted llama-server without it" in retired.message, retired.message
        assert completion(url)[0] == base_text
    finally:
        if pid_file.is_file():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
