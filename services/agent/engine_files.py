"""Putting an adapter where an engine reads it: whole or not at all, linked to the node's cached copy."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from services.agent.engines import Engine


def placed(engine: Engine, name: str) -> Path:
    """Where the adapter served under `name` goes: DIR/NAME (vLLM's resolver) or DIR/NAME.gguf (llama.cpp)."""
    assert engine.directory is not None, f"{engine.label} places no files"
    return engine.directory / (f"{name}.gguf" if engine.kind == "llamacpp" else name)


def place(src: Path, target: Path, base_model: str | None = None) -> None:
    """Copy beside the target, then rename over it: an engine never sees half an adapter. base_model: what the
    adapter's base_model_name_or_path becomes (vLLM's resolver loads only a match)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.new")
    remove(tmp)
    if src.is_dir():
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, tmp)
    if base_model is not None and (config := tmp / "adapter_config.json").is_file():
        settings = json.loads(config.read_text())
        settings["base_model_name_or_path"] = base_model
        config.unlink()  # a link to the node's cached copy: write a file of its own
        config.write_text(json.dumps(settings, indent=2))
    old = target.with_name(f".{target.name}.old")
    remove(old)
    if target.exists():
        os.rename(target, old)
    os.rename(tmp, target)
    remove(old)


def _link_or_copy(src, dst) -> None:
    """A hard link to the node's cached copy where the file system allows it (no bytes copied), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
