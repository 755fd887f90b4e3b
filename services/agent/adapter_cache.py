"""A node's fetched adapters (one directory per sha256) kept under a byte budget: the least recently used go first,
never one an engine serves, one on its way into an engine, or the one just fetched.

The agent trims it with evict_async, which walks and removes in a thread; so that nothing uses a directory while it
goes, a directory is removed only if no load holds it at that moment (checked and marked doomed under a lock that
guards only those two sets), and a holder that meets a doomed one waits until it is gone (settled())."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from services.agent.budget import to_remove

log = logging.getLogger(__name__)
GOING = ".evicting-"  # a directory on its way out is renamed to this prefix first, then removed


class AdapterCache:
    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root, self.budget = root, budget_bytes
        self.held: collections.Counter[str] = collections.Counter()  # sha256 -> loads under way that need it
        self.doomed: set[str] = set()  # sha256s an eviction under way removes
        self._guard = threading.Lock()  # held and doomed, between the loop and the evicting thread (no I/O under it)
        self._evicting = asyncio.Lock()  # one eviction at a time

    @contextlib.contextmanager
    def holding(self, sha256: str) -> Iterator[None]:
        """While an engine is being given this adapter (or it is fetched), it is not evicted (it is `served` once
        the load is remembered). One that an eviction under way has doomed: await settled() before using it."""
        with self._guard:
            self.held[sha256] += 1
        try:
            yield
        finally:
            with self._guard:
                self.held[sha256] -= 1
                if self.held[sha256] <= 0:
                    del self.held[sha256]

    async def settled(self, sha256: str) -> None:
        """Return once no eviction is removing this adapter (call it holding it: then none starts to)."""
        while sha256 in self.doomed:
            await asyncio.sleep(0.05)

    def used(self, sha256: str) -> None:
        """Mark it the most recently used (blocking: a disk write; the deployment runs it in a thread)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.root / sha256)

    def present(self, sha256: str, path: Path) -> bool:
        """Whether `path` (inside the adapter's directory) is on disk, marked most recently used if so (blocking:
        the deployment runs it in a thread)."""
        if not path.exists():
            return False
        self.used(sha256)
        return True

    async def evict_async(self, served: Iterable[str], fetched: str = "") -> list[str]:
        """evict() in a thread, off the event loop; one eviction at a time."""
        served = set(served)
        async with self._evicting:
            return await asyncio.to_thread(self.evict, served, fetched)

    def evict(self, served: Iterable[str], fetched: str = "") -> list[str]:
        """Remove the least recently used adapters until the cache fits its budget; what an engine serves, what a
        load holds and `fetched` stay even over it. Returns the sha256s removed. Blocking (walks and removes
        directories): the agent calls evict_async."""
        if not self.root.is_dir():
            return []
        dirs = {d.name: d for d in self.root.iterdir() if d.is_dir()}
        for name in [n for n in dirs if n.startswith(GOING)]:  # what a crash left half removed
            shutil.rmtree(dirs.pop(name), ignore_errors=True)
        sizes = {name: _bytes(d) for name, d in dirs.items()}
        entries = [(name, d.stat().st_mtime, sizes[name]) for name, d in dirs.items()]
        with self._guard:
            keep = {*served, *self.held, fetched}
        candidates, kept = to_remove(entries, self.budget, keep)
        removed = []
        try:
            for name in candidates:
                if self._remove(dirs[name]):
                    removed.append(name)
                    log.info(
                        "adapter cache: removed %s (%.1f MiB, used least recently) to stay under %d MiB",
                        name[:12],
                        sizes[name] / 2**20,
                        self.budget // 2**20,
                    )
                else:
                    kept += sizes[name]
        finally:
            with self._guard:
                self.doomed.difference_update(candidates)
        if kept > self.budget:
            log.warning(
                "adapter cache: %.0f MiB kept, over its %d MiB budget, because engines serve (or are loading) all of "
                "it; raise --adapter-cache-mib or retire adapters",
                kept / 2**20,
                self.budget // 2**20,
            )
        return removed

    def _remove(self, directory: Path) -> bool:
        """Remove one adapter unless a load took hold of it meanwhile: doomed under the guard, renamed out of the
        way (a fetch after that finds nothing and fetches it again), then deleted."""
        with self._guard:
            if directory.name in self.held:
                return False
            self.doomed.add(directory.name)
        going = directory.with_name(GOING + directory.name)
        try:
            os.rename(directory, going)
        except FileNotFoundError:
            return False
        shutil.rmtree(going, ignore_errors=True)
        return True


def _bytes(directory: Path) -> int:
    """Its files' bytes; one that goes while they are counted (a fetch's partial file renamed) counts nothing."""
    total = 0
    for f in directory.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            total += f.stat().st_size if f.is_file() else 0
    return total
