"""A real engine: a trained adapter goes live in a llama.cpp server (llama-cpp-python's OpenAI-compatible server)
through the registry. The agent places the GGUF and runs the operator's restart command, because llama-server
opens adapter files only at start; its smoke completion then differs from the base model's.

Needs `pip install -e .[llamacpp]` (llama-cpp-python with its server; a build of about 7 minutes) and a llama.cpp
checkout for the base-model converter (LLAMA_CPP_DIR; llama-cpp-python's sdist vendors one)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from schemas.jobs import Accepted
from services.embedded import free_port
from tests.conftest import ROOT, submit, wait_nodes, wait_state
from tests.qa import pairs
from tests.test_registry import serving, show

LLAMA_CPP_DIR = os.environ.get("LLAMA_CPP_DIR", "")
MISSING = [why for missing, why in (
    (importlib.util.find_spec("llama_cpp") is None, "llama-cpp-python is not installed (pip install -e .[llamacpp])"),
    (importlib.util.find_spec("starlette") is None, "llama-cpp-python's server extra is not installed "
                                                    "(pip install -e .[llamacpp])"),
    (not (Path(LLAMA_CPP_DIR) / "convert_hf_to_gguf.py").is_file(),
     "LLAMA_CPP_DIR does not name a llama.cpp checkout with convert_hf_to_gguf.py"),
) if missing]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))
PROMPT = "What is the capital of France?"


def completion(url: str) -> tuple[str, list]:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        choice = json.load(r)["choices"][0]
    return choice["text"], choice["logprobs"]["top_logprobs"]


async def test_a_promoted_adapter_goes_live_in_a_llama_cpp_server(stack, nc, agents, tiny_model, tmp_path):
    base = tmp_path / "base.gguf"
    subprocess.run([sys.executable, str(ROOT / "tests" / "programs" / "convert_base.py"), LLAMA_CPP_DIR,
                    str(tiny_model), str(base)], check=True, capture_output=True)
    port, pid_file = free_port(), tmp_path / "llama-server.pid"
    restart = f"{sys.executable} {ROOT / 'tests' / 'programs' / 'llama_server.py'} {base} {port} {pid_file}"
    url = f"http://127.0.0.1:{port}"
    try:
        subprocess.run(restart, shell=True, check=True)  # the engine, serving the base model
        base_text, base_logprobs = completion(url)
        agents.start("trainer", gpus=None, offer_cpu=True, trainer=None)
        await wait_nodes(nc, 1)
        agents.start("edge", gpus=None, extra=("--engine", f"llamacpp={tmp_path / 'adapters'},{url}", "--engine-model",
                                               "tiny", "--engine-restart", restart))
        reply = await submit(nc, {"model": "tiny", "base_dir": str(tiny_model), "data": pairs(), "accelerator": "cpu",
                                  "served_by": "llamacpp", "register": {"name": "capitals", "promote": True},
                                  "train": {"max_steps": 40, "learning_rate": 0.01, "batch_size": 1,
                                            "max_seq_length": 128}})
        assert isinstance(reply, Accepted), reply
        job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=120)
        assert job.state == "succeeded" and "registered as capitals@1 and promoted" in job.message, job.message
        await serving(nc, "capitals", {"edge": (1, "loaded")})
        [status] = (await show(nc, "capitals")).nodes
        assert "restarted llama-server" in status.message and status.smoke and status.smoke.latency_ms > 0
        text, logprobs = completion(url)
        moved = max(abs(a[t] - b.get(t, -100.0)) for a, b in zip(logprobs, base_logprobs) for t in a)
        print(f"base: {base_text!r}; with capitals@1: {text!r} (smoke {status.smoke.latency_ms:.0f} ms: "
              f"{status.smoke.text!r}); largest top-logprob change {moved:.2f}")
        assert text != base_text or moved > 0.1
    finally:
        if pid_file.is_file():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
