"""The identity of a base model as jobs that share it see it: a digest over the content of every file a trainer
reads from its directory (config.json, the tokenizer's files, every tensor byte of the safetensors files), so two
directories have equal digests exactly when they hold the same model. Co-training groups are keyed by it (the
agent advertises it in heartbeats, schemas/co_train.py group_key) and a group's process refuses a joiner whose
base has another (trainer/co_train/process.py).

Hashing a base reads all of it (measured on the 2-core machine: 0.53 s for a 1 GiB safetensors file, in the page
cache or not; sha256 is the bound, ~1.9 GiB/s; so ~8 s for an 8B model in bf16), so each file's digest is kept by
what identifies its content on disk, its path, size, mtime, ctime, inode and device: a file replaced or rewritten is
hashed again, an unchanged one never (a lookup: 150 us). The ctime is what makes a rewrite in place show: any write
sets it and nothing can set it back, while the mtime can be (`cp -p`, `rsync -t --inplace`, a restore put the old
one back on new bytes of the same size). Pure Python (hashlib): the agent calls it in a thread."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

# what transformers reads from a model directory: the config, the tokenizer's files, the weights (never pickles)
READ_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken")
CHUNK = 8 * 2**20
PREFIX = "sha256:"

FileKey = tuple[str, int, int, int, int, int]  # (path, size, mtime_ns, ctime_ns, inode, device)


def read_files(directory: str | Path) -> list[Path]:
    """The files of `directory` whose content makes the model: those a trainer may read, by name."""
    path = Path(directory)
    return sorted(p for p in path.iterdir() if p.suffix in READ_SUFFIXES and p.is_file())


def file_key(path: Path) -> FileKey:
    st = os.stat(path)
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def sha256_of(path: Path) -> str:
    """The file's sha256, read in large chunks (hashlib lets go of the GIL while it hashes one)."""
    h, buffer = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


class FileDigests:
    """Each file's sha256, computed once while the file stays as it was (its FileKey); safe from several threads
    (one reads a file while another asking for it waits for its digest)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[FileKey, str]] = {}
        self._lock = threading.Lock()
        self._reading: dict[str, threading.Lock] = {}  # per path: one thread hashes it at a time
        self.hashed_bytes = 0  # read to hash so far (what a cache hit spares)

    def file(self, path: Path) -> str:
        name = str(path.resolve())
        with self._lock:
            reading = self._reading.setdefault(name, threading.Lock())
        with reading:
            key = file_key(path)
            with self._lock:
                known = self._known.get(name)
            if known is not None and known[0] == key:
                return known[1]
            digest = sha256_of(path)
            if file_key(path) != key:  # changed while it was read: what was read is no one state of it
                raise OSError(f"{path} changed while it was hashed; it is hashed again once it is written")
            with self._lock:
                self._known[name] = (key, digest)
                self.hashed_bytes += key[1]
            return digest

    def directory(self, directory: str | Path) -> str:
        """The model's digest: sha256 over each read file's name and content digest, in name order. OSError when
        the directory or a file cannot be read; ValueError when it holds no weights."""
        files = read_files(directory)
        if not any(p.suffix == ".safetensors" for p in files):
            raise ValueError(f"{directory} holds no safetensors weights")
        h = hashlib.sha256()
        for p in files:
            h.update(p.name.encode() + b"\0" + self.file(p).encode() + b"\n")
        return PREFIX + h.hexdigest()


def content_digest(directory: str | Path, digests: FileDigests | None = None) -> str:
    """The digest of a model directory (FileDigests.directory), with a cache of its own unless one is given."""
    return (digests or FileDigests()).directory(directory)


__all__ = ["FileDigests", "content_digest", "read_files"]
