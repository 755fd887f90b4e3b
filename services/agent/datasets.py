"""A node's copy of the datasets its jobs train on: fetched once per sha256, kept under a byte budget, least
recently used evicted first (never one a running job reads). Its disk work runs in threads, off the agent's event
loop (which also sends the node's heartbeats)."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import msgspec

from schemas import names
from schemas.datasets import DatasetInfo
from schemas.jobs import DatasetRef
from services.agent.budget import to_remove
from services.transfer.datasets import find_dataset
from services.transfer.download import fetch_object

log = logging.getLogger(__name__)
_info = msgspec.json.Decoder(DatasetInfo)


class DatasetUnavailable(Exception):
    """The dataset a job names cannot be had as it was submitted: what happened and what to do."""


@dataclass
class LocalDataset:
    path: Path
    info: DatasetInfo


class DatasetCache:
    def __init__(self, js, root: Path, budget_bytes: int) -> None:
        self.js, self.root, self.budget = js, root, budget_bytes
        self.tokens = root / "tokens"  # the trainer's tokenized copies, one directory per dataset sha256 and tokenizer
        self.locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.in_use: collections.Counter[str] = collections.Counter()

    def _paths(self, sha256: str) -> tuple[Path, Path]:
        return self.root / f"{sha256}.jsonl", self.root / f"{sha256}.json"

    async def acquire(self, ref: DatasetRef) -> LocalDataset:
        """The dataset on local disk (fetched if it is not there yet); release() it when the job ends."""
        if ref.sha256 is None:
            raise DatasetUnavailable(
                f"dataset {ref.name} reached the node without its sha256 pin (an old scheduler?); resubmit the job"
            )
        async with self.locks[ref.sha256]:  # two jobs on one dataset: one download
            data, meta = self._paths(ref.sha256)
            info = await asyncio.to_thread(_cached, data, meta)
            if info is None:
                info = await self._fetch(ref, data, meta)
            self.in_use[ref.sha256] += 1
        await asyncio.to_thread(self._evict, set(self.in_use))
        return LocalDataset(data, info)

    def release(self, local: LocalDataset) -> None:
        self.in_use[local.info.sha256] -= 1
        if self.in_use[local.info.sha256] <= 0:
            del self.in_use[local.info.sha256]

    async def _fetch(self, ref: DatasetRef, data: Path, meta: Path) -> DatasetInfo:
        stored = names.dataset_object(ref.name, ref.owner)
        info = await find_dataset(self.js, stored)
        if info is None:
            raise DatasetUnavailable(
                f"dataset {ref.name} was deleted after the job was submitted; upload it again "
                "(`jetlora datasets put`) and resubmit the job"
            )
        if info.sha256 != ref.sha256 and ref.sha256 is not None:
            raise DatasetUnavailable(
                f"dataset {ref.name} was replaced after the job was submitted (it held sha256 "
                f"{ref.sha256[:12]}…, now {info.sha256[:12]}…); resubmit the job to train on the "
                "new content"
            )
        await fetch_object(self.js, names.DATASETS_BUCKET, stored, data, info.sha256)
        await asyncio.to_thread(meta.write_bytes, msgspec.json.encode(info))
        log.info("dataset %s (%s, %d bytes) fetched into %s", ref.name, info.sha256[:12], info.size, data)
        return info

    def _evict(self, in_use: set[str]) -> None:
        """Remove least recently used datasets, with their tokenized copies, until the cache fits its budget (which
        counts both); those `in_use` (taken on the loop: the jobs' counts change there) stay. Blocking: run in a
        thread."""
        files = {p.stem: p for p in self.root.glob("*.jsonl")}
        sizes = {sha: self._size(sha) for sha in files}
        entries = [(sha, p.stat().st_mtime, sizes[sha]) for sha, p in files.items()]
        for sha in to_remove(entries, self.budget, in_use)[0]:
            for own in self._paths(sha):
                own.unlink(missing_ok=True)
            for tokenized in self.tokens.glob(f"{sha}-*"):
                shutil.rmtree(tokenized, ignore_errors=True)
            log.info(
                "dataset cache: evicted %s (%.1f MiB with its tokenized copies) to stay under %d MiB",
                sha[:12],
                sizes[sha] / 2**20,
                self.budget // 2**20,
            )

    def _size(self, sha256: str) -> int:
        """The bytes one dataset holds here: its rows, its description, and every tokenized copy of it."""
        own = sum(p.stat().st_size for p in self._paths(sha256) if p.is_file())
        return own + sum(f.stat().st_size for d in self.tokens.glob(f"{sha256}-*") for f in d.rglob("*") if f.is_file())


def _cached(data: Path, meta: Path) -> DatasetInfo | None:
    """The dataset's description where it is here already, marked the most recently used; None where it must be
    fetched (blocking: run in a thread)."""
    if not (data.is_file() and meta.is_file()):
        return None
    os.utime(data)
    return _info.decode(meta.read_bytes())
