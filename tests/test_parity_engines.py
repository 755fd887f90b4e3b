"""Train/serve parity against real engines (each skipped where it is not installed): a trained adapter served as
trained is reported `loaded` with its parity within the limit its engine's floor sets; the same adapter with its
lora_B scaled by 1.05 behind the agent's back (its probe's greedy tokens may still agree) is reported `mismatch`,
with the figures. vLLM for CPU (JETLORA_VLLM_PYTHON, as tests/test_engine_vllm.py) is asked with logprob_token_ids,
while other requests keep it busy (its prompt_logprobs path kills the engine then); llama-cpp-python's server (as
tests/test_engine_llamacpp.py) for echoed logprobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas import names
from schemas.jobs import Accepted
from schemas.registry import AdapterReply, PromoteRequest, RegisterRequest
from services import bus
from services.embedded import free_port
from tests import test_engine_llamacpp as llama
from tests.conftest import ROOT, submit, wait_for, wait_state
from tests.qa import pairs
from tests.test_engine_vllm import VLLM_PYTHON, Stream, Vllm, _known, engine_model, node_status
from tests.test_registry import serving, show

__all__ = ["engine_model"]  # the module's fixture: a head_dim-64 model vLLM for CPU takes


async def trained_job(nc, model: Path, **more) -> str:
    reply = await submit(
        nc,
        {
            "model": "tiny",
            "base_dir": str(model),
            "data": pairs(),
            "accelerator": "cpu",
            "lora": {"r": 8},
            "train": {"max_steps": 30, "learning_rate": 0.01, "batch_size": 2, "max_seq_length": 64},
            **more,
        },
    )
    assert isinstance(reply, Accepted), reply
    job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=300)
    assert job.state == "succeeded", job.message
    return reply.job


async def register(nc, job: str, promote: bool = False) -> int:
    reply = await bus.request(
        nc, names.ADAPTERS.register, RegisterRequest(name="capitals", job=job, promote=promote), AdapterReply
    )
    return reply.versions[-1].version


def scale_peft_b(peft: Path, factor: float) -> None:
    """Every lora_B of a PEFT adapter directory times `factor`, written as a file of its own (not through a link)."""
    from safetensors.torch import load_file, save_file

    path = peft / "adapter_model.safetensors"
    tensors = {k: v * factor if "lora_B" in k else v for k, v in load_file(path).items()}
    path.unlink()
    save_file(tensors, path)


def scale_gguf_b(path: Path, factor: float) -> None:
    """Every lora_b tensor of a GGUF LoRA times `factor`, in place (f32)."""
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    for tensor in reader.tensors:
        if tensor.name.endswith(".lora_b"):
            tensor.data[...] *= factor
    reader.data.flush()


async def good_then_scaled(nc, job: str, node: str, cached: Path, scale) -> tuple:
    """Promote the job's adapter (v1), then the same files as v2 after `scale` changed the node's cached copy:
    (v1's status, v2's status)."""
    await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="capitals", version=1), AdapterReply)
    await serving(nc, "capitals", {node: (1, "loaded")})
    good = await node_status(nc, "capitals", node)
    assert await register(nc, job) == 2
    await wait_for(lambda: _exists(cached), timeout=60, what=f"the adapter in {cached}")
    scale(cached)
    await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="capitals", version=2), AdapterReply)
    await serving(nc, "capitals", {node: (2, "mismatch")})
    return good, await node_status(nc, "capitals", node)


async def _exists(path: Path) -> bool:
    return path.exists()


def check_and_print(engine: str, good, bad) -> None:
    g, b = good.parity, bad.parity
    print(f"\n{engine} good: {good.state} {good.message}\n{engine} scaled: {bad.state} {bad.message}")
    assert g is not None and g.within is True and g.floor_mean is not None and g.tokens >= 40, good
    assert "parity: mean" in good.message
    assert b is not None and b.within is False and b.mean > g.limit, bad  # type: ignore[operator]
    assert "not its trainer's" in bad.message


@pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM for CPU here (JETLORA_VLLM_PYTHON: tests/test_engine_vllm.py)")
async def test_parity_on_a_real_vllm(stack, nc, agents, engine_model, tmp_path):
    engine = Vllm(engine_model, tmp_path / "resolver", tmp_path / "vllm.log")
    engine.start()
    try:
        agents.start("trainer", gpus=None, offer_cpu=True, trainer=None)
        await wait_for(lambda: _known(nc, "trainer"), timeout=30, what="the training node")
        job = await trained_job(nc, engine_model)
        assert await register(nc, job) == 1
        await engine.up()
        agents.start("api", gpus=None, extra=("--engine", f"vllm={engine.url}", "--engine-model", "tiny"))
        await wait_for(lambda: _known(nc, "api"), timeout=30, what="node api")
        peft = (await show(nc, "capitals")).versions[0].peft
        cached = tmp_path / "api" / "adapters" / peft.sha256 / "peft"
        with Stream(engine, "tiny") as stream:  # requests in flight while the agent measures
            good, bad = await good_then_scaled(nc, job, "api", cached, lambda p: scale_peft_b(p, 1.05))
        check_and_print("vLLM (CPU, float32)", good, bad)
        print(f"{stream.sent} requests to the base model meanwhile, {len(stream.failed)} failed")
        assert stream.sent > 0 and stream.failed == []
    finally:
        engine.stop()


@pytest.mark.skipif(bool(llama.MISSING), reason="; ".join(llama.MISSING))
async def test_parity_on_a_real_llama_cpp_server(stack, nc, agents, tiny_model, tmp_path):
    base = tmp_path / "base.gguf"
    convert = [sys.executable, str(ROOT / "tests" / "programs" / "convert_base.py"), llama.LLAMA_CPP_DIR]
    subprocess.run([*convert, str(tiny_model), str(base)], check=True, capture_output=True)
    port, pid_file = free_port(), tmp_path / "llama-server.pid"
    restart = f"{sys.executable} {ROOT / 'tests' / 'programs' / 'llama_server.py'} {base} {port} {pid_file}"
    url = f"http://127.0.0.1:{port}"
    try:
        agents.start(
            "edge",
            gpus=None,
            extra=("--engine", f"llamacpp={tmp_path / 'adapters'},{url}", "--engine-model", "tiny")
            + ("--engine-restart", restart),
        )
        await wait_for(lambda: llama.answers(url), timeout=90, what="the agent to start llama-server")
        agents.start("trainer", gpus=None, offer_cpu=True, trainer=None)
        await wait_for(lambda: _known(nc, "trainer"), timeout=30, what="the training node")
        job = await trained_job(nc, tiny_model, served_by="llamacpp")
        assert await register(nc, job) == 1
        gguf = (await show(nc, "capitals")).versions[0].gguf
        assert gguf is not None
        cached = tmp_path / "edge" / "adapters" / gguf.sha256 / "adapter.gguf"
        good, bad = await good_then_scaled(nc, job, "edge", cached, lambda p: scale_gguf_b(p, 1.05))
        check_and_print("llama-cpp-python server (f32 GGUF, f16 KV cache)", good, bad)
    finally:
        if pid_file.is_file():
            try:
                os.kill(int(pid_file.read_text()), 15)
            except ProcessLookupError:
                pass
