"""A node's fetched adapters (one directory per sha256) kept under a byte budget: the least recently used go first,
never one an engine serves, one on its way into an engine, or the one just fetched."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from services.agent.budget import to_remove

log = logging.getLogger(__name__)


class AdapterCache:
    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root, self.budget = root, budget_bytes
        self.held: collections.Counter[str] = collections.Counter()  # sha256 -> loads under way that need it

    @contextlib.contextmanager
    def holding(self, sha256: str) -> Iterator[None]:
        """While an engine is being given this adapter, it is not evicted (it is `served` once the load is
        remembered)."""
        self.held[sha256] += 1
        try:
            yield
        finally:
            self.held[sha256] -= 1
            if self.held[sha256] <= 0:
                del self.held[sha256]

    def used(self, sha256: str) -> None:
        """Mark it the most recently used."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.root / sha256)

    def evict(self, served: Iterable[str], fetched: str = "") -> list[str]:
        """Remove the least recently used adapters until the cache fits its budget; what an engine serves, what a
        load holds and `fetched` stay even over it. Returns the sha256s removed."""
        if not self.root.is_dir():
            return []
        dirs = {d.name: d for d in self.root.iterdir() if d.is_dir()}
        sizes = {name: _bytes(d) for name, d in dirs.items()}
        entries = [(name, d.stat().st_mtime, sizes[name]) for name, d in dirs.items()]
        removed, kept = to_remove(entries, self.budget, {*served, *self.held, fetched})
        for name in removed:
            shutil.rmtree(dirs[name], ignore_errors=True)
            log.info(
                "adapter cache: removed %s (%.1f MiB, used least recently) to stay under %d MiB",
                name[:12],
                sizes[name] / 2**20,
                self.budget // 2**20,
            )
        if kept > self.budget:
            log.warning(
                "adapter cache: %.0f MiB kept, over its %d MiB budget, because engines serve (or are loading) all of "
                "it; raise --adapter-cache-mib or retire adapters",
                kept / 2**20,
                self.budget // 2**20,
            )
        return removed


def _bytes(directory: Path) -> int:
    """Its files' bytes; one that goes while they are counted (a fetch's partial file renamed) counts nothing."""
    total = 0
    for f in directory.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            total += f.stat().st_size if f.is_file() else 0
    return total
