"""vLLM: adapters loaded through its runtime LoRA API (needs --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING),
or placed for its filesystem resolver (VLLM_PLUGINS=lora_filesystem_resolver, VLLM_LORA_RESOLVER_CACHE_DIR=DIR).

A new version replaces the old one in place (`load_inplace`), so no request under the name is ever refused during
a swap; a vLLM that predates it gets unload then load, and the agent says the swap had a gap. vLLM's resolver is
asked only about names vLLM does not know, and it loads a directory only if its adapter_config.json's
`base_model_name_or_path` equals vLLM's own `--model` (model_config.model, what /v1/models reports as the base
model's `root`): so a placed version is made known by unloading the name (the next request resolves it again),
and the agent writes that root into the config.

Past an engine's cap (engine_cap.py) a name is parked: unloaded, its resolver directory left placed; which adapters
requests use is read from vLLM's /metrics (`vllm:lora_requests_info`)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from schemas.registry import NodeState
from services.agent.engine_http import EngineHttp
from services.agent.engine_load import fetch_text
from services.agent.engines import Engine, EngineError, get_json, post_json
from services.agent.engine_files import place, placed, remove

NEEDS = "it needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"
LORA_INFO = "vllm:lora_requests_info"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


async def models(engine: Engine, *, http: EngineHttp) -> list[dict] | None:
    """vLLM's /v1/models entries, or None when it does not answer."""
    code, body = await get_json(f"{engine.url}/v1/models", http=http)
    if code != 200 or not isinstance(body, dict):
        return None
    return [m for m in body.get("data", []) if isinstance(m, dict)]


async def served(engine: Engine, *, http: EngineHttp) -> dict[str, str] | None:
    """The adapters vLLM serves now, name -> the path it loaded each from; None when it does not answer (or no
    address was given)."""
    entries = await models(engine, http=http) if engine.url else None
    return None if entries is None else _adapters(entries)


def _adapters(entries: list[dict]) -> dict[str, str]:
    return {m["id"]: str(m.get("root", "")) for m in entries if m.get("parent")}


async def load(engine: Engine, name: str, local: Path, *, http: EngineHttp) -> tuple[NodeState, str]:
    """Serve `local` (a PEFT directory) under `name`, replacing what the name served."""
    if not engine.url:  # vllm-dir=DIR alone
        target = placed(engine, name)
        await asyncio.to_thread(place, local, target, engine.model)
        return "placed", (
            f"placed in {target}; with no engine URL (vllm-dir=DIR,URL) nothing unloads an older "
            "version from vLLM or checks what it serves"
        )
    entries = await models(engine, http=http)
    if entries is None:
        raise EngineError(f"vLLM at {engine.url} does not answer")
    now = _adapters(entries)
    if engine.kind == "vllm-dir":
        return await _place_for_resolver(engine, name, local, entries, http=http)
    if name not in now:
        return await _load(engine, name, local, "loaded through vLLM's /v1/load_lora_adapter", http=http)
    code, text = await post_json(
        f"{engine.url}/v1/load_lora_adapter",
        {"lora_name": name, "lora_path": str(local), "load_inplace": True},
        http=http,
    )
    if code == 200:
        return "loaded", "replaced in place through vLLM's /v1/load_lora_adapter (load_inplace: no request refused)"
    if "already been loaded" not in text:
        raise EngineError(f"vLLM refused to load it ({code}: {text[:300]}); {NEEDS}")
    await post_json(f"{engine.url}/v1/unload_lora_adapter", {"lora_name": name}, http=http)  # no load_inplace
    return await _load(
        engine,
        name,
        local,
        "unloaded the old version and loaded this one (this vLLM has no "
        "load_inplace: requests in between were refused; upgrade vLLM)",
        http=http,
    )


async def _load(engine: Engine, name: str, local: Path, said: str, *, http: EngineHttp) -> tuple[NodeState, str]:
    code, text = await post_json(
        f"{engine.url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(local)}, http=http
    )
    if code != 200:
        raise EngineError(f"vLLM refused to load it ({code}: {text[:300]}); {NEEDS}")
    return "loaded", said


async def unload(engine: Engine, name: str, *, http: EngineHttp) -> tuple[NodeState, str]:
    said = ""
    if engine.kind == "vllm-dir":
        target = placed(engine, name)
        await asyncio.to_thread(remove, target)
        said = f"removed {target}"
        if not engine.url:
            return "unloaded", f"{said} (no engine URL: vLLM keeps serving it if it had loaded it)"
        said += "; "
    now = await served(engine, http=http)
    if now is None:
        raise EngineError(f"vLLM at {engine.url} does not answer; it unloads {name} once it does")
    if name in now:
        code, text = await post_json(f"{engine.url}/v1/unload_lora_adapter", {"lora_name": name}, http=http)
        if code != 200:
            raise EngineError(f"vLLM refused to unload it ({code}: {text[:300]})")
    return "unloaded", said + "unloaded through vLLM's /v1/unload_lora_adapter"


async def park(engine: Engine, name: str, *, http: EngineHttp) -> tuple[NodeState, str]:
    """Unload `name` from vLLM to make room, still promoted: the runtime API forgets it (`unloaded`); for the
    filesystem resolver its directory stays placed, so vLLM loads it again at its next request (`on-demand`)."""
    if name in (await served(engine, http=http) or {}):
        code, text = await post_json(f"{engine.url}/v1/unload_lora_adapter", {"lora_name": name}, http=http)
        if code != 200 and code != 404:
            raise EngineError(f"vLLM refused to unload it ({code}: {text[:300]})")
    if engine.kind == "vllm-dir":
        return "on-demand", (
            f"unloaded from vLLM, left placed in {placed(engine, name)}: vLLM loads it again at its next request "
            "(unverified until then)"
        )
    return "unloaded", "unloaded through vLLM's /v1/unload_lora_adapter, loaded again when there is room"


async def in_flight(engine: Engine, *, http: EngineHttp) -> set[str] | None:
    """The adapters vLLM's newest `vllm:lora_requests_info` shows in running or waiting requests; None when its
    metrics cannot be read or have no such series (LoRA off, or no request yet)."""
    try:
        text = await fetch_text(f"{engine.url}/metrics", 2.0, http=http)
    except OSError:
        return None
    return lora_in_flight(text)


def lora_in_flight(metrics: str) -> set[str] | None:
    """From a /metrics page: the series of vllm:lora_requests_info with the newest value (a wall-clock time: vLLM
    keeps a series per label set it ever had), its running and waiting adapters' names."""
    newest: tuple[float, dict[str, str]] | None = None
    for line in metrics.splitlines():
        if not line.startswith(LORA_INFO + "{"):
            continue
        labels, _, value = line[len(LORA_INFO) + 1 :].rpartition("}")
        try:
            at = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        if newest is None or at > newest[0]:
            newest = at, dict(_LABEL.findall(labels))
    if newest is None:
        return None
    lists = (newest[1].get("running_lora_adapters", ""), newest[1].get("waiting_lora_adapters", ""))
    return {name.strip() for names in lists for name in names.split(",") if name.strip()}


async def _place_for_resolver(
    engine: Engine, name: str, local: Path, entries: list[dict], *, http: EngineHttp
) -> tuple[NodeState, str]:
    known = name in _adapters(entries)
    base = next((str(m.get("root")) for m in entries if not m.get("parent")), None)
    if base is None:
        raise EngineError(f"vLLM at {engine.url} lists no base model")
    target = placed(engine, name)
    await asyncio.to_thread(place, local, target, base)
    if known:  # vLLM serves the old version until the name is unknown to it again
        code, text = await post_json(f"{engine.url}/v1/unload_lora_adapter", {"lora_name": name}, http=http)
        if code != 200 and code != 404:
            raise EngineError(
                f"placed {target}, but vLLM refused to unload the old version ({code}: {text[:300]}); {NEEDS}"
            )
    return "loaded", f"placed in {target} for vLLM's filesystem resolver (base_model_name_or_path {base})"
