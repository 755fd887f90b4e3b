"""The serving engines on a node and what every kind shares: how one is named on the command line, what it can
serve, how to ask it over HTTP (through its caller's session, engine_http.py), and whether it answers an adapter's
probe as its trainer did. How each kind loads an adapter is its own module: services/agent/vllm.py (runtime API and
filesystem resolver), llamacpp.py."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from schemas.events import RolloutEngine
from schemas.jobs import JobRequest
from schemas.job_status import PROBE_PROMPT, PROBE_TOKENS
from schemas.parity import PARITY_EPSILON, PARITY_FACTOR
from schemas.registry import AdapterVersion, NodeState, Smoke
from schemas.training import MUTATING_INITS
from services.agent.engine_http import EngineHttp

HTTP_TIMEOUT_S = 30.0


@dataclass
class Engine:
    """One engine: `--engine vllm=URL`, `--engine vllm-dir=DIR[,URL]` or `--engine llamacpp=DIR[,URL]`, with the
    base model it serves (`--engine-model`), the largest LoRA rank it takes and, for llama.cpp, what restarts it."""

    kind: str  # "vllm" | "vllm-dir" | "llamacpp"
    model: str
    url: str = ""  # the engine's HTTP address (completions for the probe; vLLM's load API)
    directory: Path | None = None  # where adapters are placed (vllm-dir, llamacpp)
    max_rank: int = 64
    modules: set[str] = field(
        default_factory=lambda: {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    )
    restart: str = ""  # llama.cpp: a shell command that restarts the server with the placed adapters
    max_adapters: int = 0  # vLLM: the most adapter names loaded at once, the least recently used unloaded (0: any)
    parity_factor: float = PARITY_FACTOR  # parity beyond factor x its floor + epsilon is a mismatch (parity.py)
    parity_epsilon: float = PARITY_EPSILON

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
            fix = (
                "start vLLM with a larger --max-lora-rank and the agent with a larger --engine-max-rank"
                if self.kind in ("vllm", "vllm-dir")
                else "start the agent with a larger --engine-max-rank"
            )
            return f"its rank {v.r} is above this engine's max LoRA rank {self.max_rank}; {fix}"
        if unknown := sorted(set(v.target_modules) - self.modules):
            return f"it adapts {', '.join(unknown)}, which this engine cannot serve"
        if self.kind == "llamacpp" and v.gguf is None:
            return "its job made no GGUF (submit with served_by: llamacpp)"
        return None

    def needs(self, v: AdapterVersion):
        """The stored file this engine loads: the GGUF for llama.cpp, the PEFT directory for vLLM."""
        return v.gguf if self.kind == "llamacpp" else v.peft


def rollout_engine(engines: list[Engine], request: JobRequest, priority: int) -> tuple[RolloutEngine | None, str]:
    """The vLLM a grpo job samples through (train.rollouts engine or auto), or why this node has none: a vLLM of
    the job's base model with an address (its runtime LoRA API), able to load the job's adapter."""
    t, lora = request.train, request.lora
    if t.method != "grpo" or t.rollouts == "trainer":
        return None, ""
    fits = [e for e in engines if e.kind == "vllm" and e.url and e.model == request.model]
    if not fits:
        return None, (
            f"this node has no vLLM engine of {request.model} (an agent started with --engine vllm=URL "
            f"--engine-model {request.model})"
        )
    engine = fits[0]
    rank = 2 * lora.r if lora.init in MUTATING_INITS else lora.r  # a pissa or loftq adapter is served at 2r
    if rank > engine.max_rank:
        return (
            None,
            f"its vLLM takes LoRA ranks up to {engine.max_rank} (--engine-max-rank), and this adapter's is {rank}",
        )
    if unknown := sorted(set(lora.target_modules) - engine.modules):
        return None, f"its vLLM cannot serve an adapter of {', '.join(unknown)}"
    return RolloutEngine(url=engine.url, priority=priority), ""


class EngineError(Exception):
    pass


def _whole_characters(text: str) -> str:
    """A token that holds part of a UTF-8 character decodes as U+FFFD in transformers and vLLM, and as nothing in
    llama-server: the same tokens, rendered apart. Compare what both render."""
    return text.replace("\ufffd", "")


async def post_json(url: str, body: dict, timeout: float = HTTP_TIMEOUT_S, *, http: EngineHttp) -> tuple[int, str]:
    """(status, text) of the engine's answer to a JSON POST, an error status included; raises NoAnswer (an
    OSError, saying why) where nothing answered within `timeout`."""
    status, data = await http.request("POST", url, timeout, body)
    return status, data.decode(errors="replace")


async def get_json(url: str, timeout: float = 2.0, *, http: EngineHttp) -> tuple[int, object]:
    """(status, decoded body); (status, None) for an error status; (0, None) when nothing answers (or the body is
    not JSON)."""
    try:
        status, data = await http.request("GET", url, timeout)
    except OSError:
        return 0, None
    if not 200 <= status < 300:
        return status, None
    try:
        return status, json.loads(data or b"null")
    except ValueError:
        return 0, None


async def answering(engine: Engine, *, http: EngineHttp) -> bool:
    """Whether the engine's HTTP server answers (its model list)."""
    return bool(engine.url) and (await get_json(f"{engine.url}/v1/models", http=http))[0] == 200


async def complete(
    engine: Engine, name: str, prompt: str = PROBE_PROMPT, max_tokens: int = PROBE_TOKENS, *, http: EngineHttp
) -> Smoke:
    """A greedy completion through the engine under the adapter's name (OpenAI's completions API, which vLLM and
    llama-server both serve; llama-server serves its one model whatever the name). No repetition penalty, so greedy
    means what it does in the trainer (llama-cpp-python's server applies 1.1 unless told)."""
    t0 = time.monotonic()
    code, text = await post_json(
        f"{engine.url}/v1/completions",
        {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "repeat_penalty": 1.0},
        http=http,
    )
    if code != 200:
        raise EngineError(f"a completion under {name} failed ({code}): {text[:300]}")
    return Smoke(latency_ms=round((time.monotonic() - t0) * 1000, 1), text=json.loads(text)["choices"][0]["text"][:200])


async def verify(engine: Engine, v: AdapterVersion, *, http: EngineHttp) -> tuple[NodeState, str, Smoke]:
    """Whether the engine serves this version: its greedy answer to the version's probe is the trainer's (all of
    it, or at least the first PROBE_HEAD_TOKENS tokens, which is what holds across precisions); without a probe
    (an adapter registered before probes), only that it answers under the name."""
    answer = await complete(engine, v.name, http=http)
    if v.probe is None:
        return "loaded", "answers under its name (this version has no probe to check it against)", answer
    said, text, head = (_whole_characters(t) for t in (answer.text, v.probe.text, v.probe.head))
    if said == text:
        return "loaded", "answers its probe as its trainer did", answer
    if said.startswith(head):
        return (
            "loaded",
            (
                f"answers its probe's first tokens as its trainer did ({v.probe.dtype} there); the rest "
                "differs, as precisions may"
            ),
            answer,
        )
    return (
        "mismatch",
        (
            f"asked {v.probe.prompt!r}, it answered {answer.text!r} where {v.name}@{v.version}'s "
            f"trainer answered {v.probe.text!r}: the engine serves another adapter (or none) under "
            "the name"
        ),
        answer,
    )
