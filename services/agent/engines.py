"""The serving engines on a node and how an adapter is loaded into each: vLLM's runtime LoRA API, vLLM's
filesystem resolver directory, or llama.cpp's server (which opens adapter files only at start)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from schemas.registry import AdapterVersion, NodeState, Smoke

SMOKE_PROMPT = "Hello"
SMOKE_TOKENS = 8
HTTP_TIMEOUT_S = 30.0
RESTART_TIMEOUT_S = 120.0  # an engine restart command (llama-server loading a model) is waited for this long


@dataclass
class Engine:
    """One engine: `--engine vllm=URL`, `--engine vllm-dir=DIR[,URL]` or `--engine llamacpp=DIR[,URL]`, with the
    base model it serves (`--engine-model`), the largest LoRA rank it takes and, for llama.cpp, what restarts it."""

    kind: str  # "vllm" | "vllm-dir" | "llamacpp"
    model: str
    url: str = ""  # the engine's HTTP address (completions for the smoke test; vLLM's load API)
    directory: Path | None = None  # where adapters are placed (vllm-dir, llamacpp)
    max_rank: int = 64
    modules: set[str] = field(default_factory=lambda: {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"})
    restart: str = ""  # llama.cpp: a shell command that restarts the server with the placed adapters

    @property
    def label(self) -> str:
        return f"{self.kind} {self.url or self.directory}"

    @classmethod
    def parse(cls, spec: str, model: str, max_rank: int = 64, restart: str = "") -> "Engine":
        kind, _, where = spec.partition("=")
        if kind not in ("vllm", "vllm-dir", "llamacpp") or not where:
            raise ValueError(f"--engine {spec!r}: write vllm=URL, vllm-dir=DIR[,URL] or llamacpp=DIR[,URL]")
        if kind == "vllm":
            return cls(kind, model, url=where.rstrip("/"), max_rank=max_rank)
        directory, _, url = where.partition(",")
        return cls(kind, model, url=url.rstrip("/"), directory=Path(directory), max_rank=max_rank, restart=restart)

    def refusal(self, v: AdapterVersion) -> str | None:
        """Why this engine cannot serve an adapter of its base model, or None (an adapter of another base model is
        never offered to it)."""
        if v.r > self.max_rank:
            fix = ("start vLLM with a larger --max-lora-rank and the agent with a larger --engine-max-rank"
                   if self.kind in ("vllm", "vllm-dir") else "start the agent with a larger --engine-max-rank")
            return f"its rank {v.r} is above this engine's max LoRA rank {self.max_rank}; {fix}"
        if unknown := sorted(set(v.target_modules) - self.modules):
            return f"it adapts {', '.join(unknown)}, which this engine cannot serve"
        if self.kind == "llamacpp" and v.gguf is None:
            return "its job made no GGUF (submit with served_by: llamacpp)"
        return None

    def needs(self, v: AdapterVersion):
        """The stored file this engine loads: the GGUF for llama.cpp, the PEFT directory for vLLM."""
        return v.gguf if self.kind == "llamacpp" else v.peft


async def post_json(url: str, body: dict, timeout: float = HTTP_TIMEOUT_S) -> tuple[int, str]:
    def send():
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    return await asyncio.to_thread(send)


async def smoke(engine: Engine, name: str) -> Smoke:
    """A short greedy completion through the engine under the adapter's name (OpenAI's completions API, which vLLM
    and llama-server both serve; llama-server serves its one model whatever the name)."""
    t0 = time.monotonic()
    code, text = await post_json(f"{engine.url}/v1/completions", {"model": name, "prompt": SMOKE_PROMPT,
                                                                  "max_tokens": SMOKE_TOKENS, "temperature": 0})
    if code != 200:
        raise EngineError(f"the smoke completion failed ({code}): {text[:300]}")
    return Smoke(latency_ms=round((time.monotonic() - t0) * 1000, 1), text=json.loads(text)["choices"][0]["text"][:200])


class EngineError(Exception):
    pass


async def load(engine: Engine, name: str, local: Path) -> tuple[NodeState, str]:
    """Make `name` serve the adapter at `local` (a PEFT directory, or a GGUF file for llama.cpp)."""
    if engine.kind == "vllm":
        await post_json(f"{engine.url}/v1/unload_lora_adapter", {"lora_name": name})  # an older version, if any
        code, text = await post_json(f"{engine.url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(local)})
        if code != 200:
            raise EngineError(f"vLLM refused to load it ({code}: {text[:300]}); it needs "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora")
        return "loaded", "loaded through vLLM's /v1/load_lora_adapter"
    target = _placed(engine, name)
    await asyncio.to_thread(_place, local, target, engine.model if engine.kind == "vllm-dir" else None)
    if engine.kind == "vllm-dir":
        return "loaded", f"placed in {target} (vLLM's filesystem resolver loads it on first use)"
    if not engine.restart:
        return "needs-restart", (f"placed {target}; llama-server opens adapters only at start: restart it with "
                                 f"--lora {target} (or give the agent --engine-restart)")
    await restart(engine, {"JETLORA_ADAPTER": name, "JETLORA_ADAPTER_PATH": str(target)})
    return "loaded", f"placed {target} and restarted llama-server"


async def restart(engine: Engine, env: dict[str, str] | None = None, timeout: float = RESTART_TIMEOUT_S) -> None:
    """Run the operator's restart command: $JETLORA_ADAPTERS lists every adapter placed for the engine (llama-server
    takes one --lora each), $JETLORA_ADAPTER(_PATH) the one just placed. The command's own exit is waited for, at
    most `timeout` s (a server it starts in the background may keep running); its stderr goes to a file, so a
    child that inherits it cannot hold the wait open."""
    placed = sorted(str(p) for p in engine.directory.glob("*.gguf")) if engine.directory and engine.directory.is_dir() else []
    with tempfile.TemporaryFile() as err:
        proc = await asyncio.create_subprocess_shell(engine.restart, env={**os.environ, "JETLORA_ADAPTERS": " ".join(placed),
                                                                          **(env or {})},
                                                     stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                                                     stderr=err, start_new_session=True)
        try:
            code = await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise EngineError(f"the restart command did not exit within {timeout:.0f}s and was killed; a command that "
                              "starts a server must start it in the background (e.g. `nohup llama-server ... &`)") from None
        if code:
            err.seek(0)
            raise EngineError(f"the restart command exited {code}: {err.read().decode(errors='replace')[-300:]}")


async def answering(engine: Engine) -> bool:
    """Whether the engine's HTTP server answers (its model list)."""
    def ask() -> bool:
        try:
            with urllib.request.urlopen(f"{engine.url}/v1/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    return bool(engine.url) and await asyncio.to_thread(ask)


async def unload(engine: Engine, name: str) -> str:
    if engine.kind == "vllm":
        code, text = await post_json(f"{engine.url}/v1/unload_lora_adapter", {"lora_name": name})
        if code != 200:
            raise EngineError(f"vLLM refused to unload it ({code}: {text[:300]})")
        return "unloaded through vLLM's /v1/unload_lora_adapter"
    target = _placed(engine, name)
    await asyncio.to_thread(_remove, target)
    return f"removed {target}" + (" (llama-server keeps it until restarted)" if engine.kind == "llamacpp" else "")


def _placed(engine: Engine, name: str) -> Path:
    assert engine.directory is not None, f"{engine.label} places no files"
    return engine.directory / (f"{name}.gguf" if engine.kind == "llamacpp" else name)


def _place(src: Path, target: Path, served_model: str | None = None) -> None:
    """Copy beside the target, then rename over it: an engine never sees half an adapter. For vLLM's filesystem
    resolver, the adapter's base_model_name_or_path becomes the model vLLM serves (it loads only a match)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.new")
    _remove(tmp)
    if src.is_dir():
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, tmp)
    if served_model is not None and (config := tmp / "adapter_config.json").is_file():
        settings = json.loads(config.read_text())
        settings["base_model_name_or_path"] = served_model
        config.unlink()  # a link to the node's cached copy: write a file of its own
        config.write_text(json.dumps(settings, indent=2))
    old = target.with_name(f".{target.name}.old")
    _remove(old)
    if target.exists():
        os.rename(target, old)
    os.rename(tmp, target)
    _remove(old)


def _link_or_copy(src, dst) -> None:
    """A hard link to the node's cached copy where the file system allows it (no bytes copied), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
