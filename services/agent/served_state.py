"""What each of a node's engines serves under each adapter name, remembered on disk (adapters/loaded.json) so that
an agent that restarts converges without loading anything twice. Read and written in threads, off the event loop
(it also sends the node's heartbeats); one write at a time, each of the whole state as it stood when it was asked.

A name unloaded to keep an engine under its cap (engine_cap.py) is remembered as parked: promoted for the engine,
not served by it, so its files are not held in the node's cache for it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path


class ServedState:
    def __init__(self, path: Path) -> None:
        self.path = path
        # engine label -> adapter name -> [version, sha256] of what that engine serves under the name
        self.loaded: dict[str, dict[str, list]] = {}
        self._saving = asyncio.Lock()

    async def read(self) -> None:
        """What the engines served when this node last wrote it down (nothing, the first time)."""
        self.loaded = await asyncio.to_thread(_read, self.path)

    def of(self, engine: str) -> dict[str, list]:
        """Adapter name -> [version, sha256] that `engine` (its label) serves."""
        return {name: what for name, what in self.loaded.get(engine, {}).items() if len(what) == 2}

    def parked(self, engine: str) -> dict[str, list]:
        """Adapter name -> [version, sha256] promoted for `engine` but unloaded from it to keep under its cap."""
        return {name: what[:2] for name, what in self.loaded.get(engine, {}).items() if len(what) > 2}

    def shas(self) -> set[str]:
        """The sha256 of every adapter some engine serves."""
        return {what[1] for by_name in self.loaded.values() for what in by_name.values() if len(what) == 2}

    async def remember(self, engine: str, name: str, what: list | None, parked: bool = False) -> None:
        """What `engine` serves under `name` now (None: nothing; parked: unloaded, still promoted): in memory at
        once, then on disk."""
        served = self.loaded.setdefault(engine, {})
        if what is None:
            served.pop(name, None)
        else:
            served[name] = [*what[:2], "parked"] if parked else list(what[:2])
        text = json.dumps(self.loaded)
        async with self._saving:
            await asyncio.to_thread(_write, self.path, text)


def _read(path: Path) -> dict[str, dict[str, list]]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _write(path: Path, text: str) -> None:
    """Written beside and renamed over: a crash leaves the old state or the new, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
