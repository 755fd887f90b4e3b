"""The identity of a base model that co-training groups share (schemas/weights_digest.py): a digest over every byte
a trainer reads from the model's directory (config, tokenizer, each tensor's values), each file hashed once while
it stays as it was. The agent advertises it once hashed, in a thread (a heartbeat may come before: the scheduler
then keys groups by the directory); two bases that differ in one tensor value get different group keys, and the
group's process lets in a joiner only onto its own base's content: the same content in another directory joins,
another content (or the same directory rewritten since the group loaded it) is handed back, naming both."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import msgspec
from safetensors.torch import load_file, save_file

from schemas.co_train import group_key
from schemas.events import Finished, Requeue, Started
from schemas.jobs import JobRequest
from schemas.weights_digest import FileDigests, content_digest
from services.agent.models import read_shape, read_shapes
from tests.test_co_train_process import GroupProcess, spec


def copy_of(model: Path, to: Path) -> Path:
    return Path(shutil.copytree(model, to))


def change_one_value(model: Path) -> None:
    """One value of one tensor of the model's weights changed (the file rewritten, as a new checkpoint would be)."""
    path = next(model.glob("*.safetensors"))
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, str(path), metadata={"format": "pt"})


def request(base_dir: Path) -> JobRequest:
    return msgspec.convert({"model": "tiny", "base_dir": str(base_dir), "data": [{"q": "q", "a": "a"}]}, JobRequest)


def test_the_digest_is_the_content_and_each_file_is_hashed_once_while_unchanged(tiny_model, tmp_path):
    digests = FileDigests()
    mine = digests.directory(tiny_model)
    assert mine.startswith("sha256:") and mine == content_digest(tiny_model)
    same = copy_of(tiny_model, tmp_path / "same")
    assert digests.directory(same) == mine  # the same content in another directory is the same model
    other = copy_of(tiny_model, tmp_path / "other")
    change_one_value(other)
    assert digests.directory(other) != mine  # one tensor value is another model
    tokenizer = copy_of(tiny_model, tmp_path / "tokenizer")
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert digests.directory(tokenizer) != mine  # so is another tokenizer

    read = digests.hashed_bytes
    assert digests.directory(tiny_model) == mine and digests.hashed_bytes == read  # known: nothing read again
    change_one_value(same)
    weights = next(same.glob("*.safetensors")).stat().st_size
    assert digests.directory(same) not in ("", mine)
    assert digests.hashed_bytes == read + weights  # the rewritten file alone is read again

    shape_a, shape_b = read_shape(str(tiny_model)), read_shape(str(other))
    assert shape_a.digest == shape_b.digest == ""  # the shape is read at once; the digest comes after
    assert group_key(request(tiny_model), shape_a)[0] == "dir:" + str(tiny_model)  # until then: this node's directory
    shape_a.digest, shape_b.digest = mine, digests.directory(other)
    assert group_key(request(tiny_model), shape_a) != group_key(request(other), shape_b)  # never one group


def test_a_file_rewritten_in_place_with_its_mtime_set_back_is_hashed_again(tiny_model, tmp_path):
    """`cp -p`, `rsync -t --inplace` or a restore put other bytes of the same size into the same inode and set the
    old mtime back: only the ctime says the file changed, and the cached digest must not outlive it."""
    model = copy_of(tiny_model, tmp_path / "model")
    digests = FileDigests()
    before = digests.directory(model)
    weights = next(model.glob("*.safetensors"))
    was = os.stat(weights)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: one value of the weights
    probe = tmp_path / "clock"
    deadline = time.monotonic() + 5  # the kernel stamps files from a coarse clock: wait until it has moved
    while (probe.write_bytes(b"."), probe.stat().st_ctime_ns)[1] <= was.st_ctime_ns:
        assert time.monotonic() < deadline, "the file clock did not move in 5 s"
    with open(weights, "r+b") as f:  # in place: the same inode
        f.write(data)
    os.utime(weights, ns=(was.st_atime_ns, was.st_mtime_ns))  # the old mtime back
    now = os.stat(weights)
    assert (now.st_size, now.st_mtime_ns, now.st_ino, now.st_dev) == (
        was.st_size,
        was.st_mtime_ns,
        was.st_ino,
        was.st_dev,
    )
    assert digests.directory(model) == content_digest(model) != before


def test_the_agent_advertises_a_digest_once_its_thread_has_hashed_the_base(tiny_model):
    shapes = read_shapes([str(tiny_model)])  # returns before the base is hashed: heartbeats go out meanwhile
    deadline = time.monotonic() + 20
    while not shapes[0].digest and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shapes[0].digest == content_digest(tiny_model)


def test_a_group_lets_in_only_its_own_bases_content_naming_both_when_it_refuses(tiny_model, tmp_path):
    base = copy_of(tiny_model, tmp_path / "base")
    twin = copy_of(tiny_model, tmp_path / "twin")
    other = copy_of(tiny_model, tmp_path / "other")
    change_one_value(other)

    def job(name: str, base_dir: Path, steps: int = 6):
        s = spec(tiny_model, tmp_path, name, max_steps=steps)
        return msgspec.structs.replace(s, request=msgspec.structs.replace(s.request, base_dir=str(base_dir)))

    group = GroupProcess()
    try:
        group.send("add", "a", job("a", base, steps=40))
        group.send("add", "twin", job("twin", twin))  # the same content elsewhere: joins
        group.send("add", "other", job("other", other))  # one value differs: refused
        refused = group.last("other")
        with group.changed:
            assert group.changed.wait_for(lambda: any(isinstance(e, Started) for e in group.events.get("a", [])), 60)
        change_one_value(base)  # the group's own directory rewritten after it loaded it
        group.send("add", "rewritten", job("rewritten", base))
        rewritten = group.last("rewritten")
        assert group.proc.stdin is not None
        group.proc.stdin.close()
        done = {j: group.last(j) for j in ("a", "twin")}
        assert group.proc.wait(timeout=60) == 0
    finally:
        group.proc.kill()
    loaded, changed, others = (content_digest(p) for p in (twin, base, other))
    assert isinstance(refused, Requeue), refused
    assert f"{other} ({others})" in refused.message and f"{base} ({loaded})" in refused.message, refused.message
    assert isinstance(rewritten, Requeue) and f"{base} ({changed})" in rewritten.message, rewritten
    assert f"({loaded})" in rewritten.message  # what the group holds: the content it loaded
    assert all(isinstance(d, Finished) and d.state == "trained" for d in done.values()), done
    assert not any(isinstance(e, Started) for j in ("other", "rewritten") for e in group.events[j])
