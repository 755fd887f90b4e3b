"""The `jetlora` command as a script uses it: exit codes, --json output, a whole job through `jetlora up`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import HOLD_TRAINER, ROOT
from tests.qa import pairs


def jetlora(*args, timeout=60, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"jetlora {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


@pytest.fixture
def up(nats_server, nc, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--nats",
            nats_server.url,
            "--node",
            "box",
            "--simulate-gpus",
            "8192",
            "--work-dir",
            str(tmp_path / "agent"),
            "--trainer-command",
            HOLD_TRAINER,
            "--co-train",
            "off",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "up.log", "w"),
        env={**__import__("os").environ, "HOLD_S": "0.3", "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = jetlora("nodes", "--nats", nats_server.url, "--json", check=False)
        if r.returncode == 0 and json.loads(r.stdout)["nodes"]:
            break
        time.sleep(0.3)
    yield nats_server.url
    proc.terminate()
    assert proc.wait(20) == 0, (tmp_path / "up.log").read_text()[-2000:]


def test_a_job_through_the_cli(up, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "model: tiny\nbase_dir: /models/tiny\ngpu_mib: 4000\nlabel: from-yaml\ndata:\n"
        + "".join(f"  - q: {json.dumps(p['q'])}\n    a: {json.dumps(p['a'])}\n" for p in pairs(2))
    )
    job = jetlora("submit", str(job_file), "--nats", up).stdout.strip()
    watched = jetlora("watch", job, "--nats", up)
    assert "succeeded" in watched.stdout and "10/10" in watched.stdout
    jobs = json.loads(jetlora("jobs", "--nats", up, "--json").stdout)["jobs"]
    assert [(j["id"], j["state"], j["label"]) for j in jobs] == [(job, "succeeded", "from-yaml")]
    assert json.loads(jetlora("jobs", "--nats", up, "--json", "--tenant", "acme").stdout)["jobs"] == []  # not acme's
    r = jetlora("job", job, "--nats", up, "--tenant", "acme", check=False)
    assert r.returncode == 1 and f"no job {job}" in r.stderr
    nodes = json.loads(jetlora("nodes", "--nats", up, "--json").stdout)["nodes"]
    assert nodes[0]["node"] == "box" and nodes[0]["devices"][0]["total_mib"] == 8192
    listed = json.loads(jetlora("artifacts", "ls", "--job", job, "--nats", up, "--json").stdout)["artifacts"]
    assert [a["kind"] for a in listed] == ["peft"]
    out = tmp_path / "adapter.tar.gz"
    got = jetlora("artifacts", "get", job, "peft", "-o", str(out), "--nats", up)
    assert "verified" in got.stdout and out.stat().st_size == listed[0]["size"]
    assert jetlora("artifacts", "rm", job, "--nats", up).stdout.strip() == f"{job}/peft"


def test_exit_codes_a_script_can_rely_on(up, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "tiny", "base_dir": "/m", "data": pairs(1), "train": {"batch_size": 0}}))
    r = jetlora("submit", str(bad), "--nats", up, check=False)
    assert r.returncode == 2 and "train.batch_size" in r.stderr
    r = jetlora("cancel", "nosuchjob", "--nats", up, check=False)
    assert r.returncode == 1 and "no job nosuchjob" in r.stderr
    r = jetlora("jobs", "--nats", "nats://127.0.0.1:1", check=False, timeout=30)
    assert r.returncode == 3 and "cannot reach NATS" in r.stderr


def test_datasets_through_the_cli(up, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": p["q"]}, {"role": "assistant", "content": p["a"]}]} for p in pairs(3)
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        "\n".join(json.dumps(r) for r in rows) + '\n{"messages": [{"role": "bot", "content": "hi"}]}\n'
        '{"messages": []}\n'
    )
    r = jetlora("datasets", "put", str(bad), "--nats", up, check=False)
    # the service refuses at the first bad row, storing nothing; the command lists the file's bad rows from its own check
    assert r.returncode == 2 and "nothing was stored" in r.stderr and "line 4: message 1 has role 'bot'" in r.stderr
    assert "the file's bad rows" in r.stderr and "line 5: messages is empty" in r.stderr, r.stderr
    assert "bad" not in jetlora("datasets", "ls", "--nats", up).stdout
    good = tmp_path / "chats.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    put = jetlora("datasets", "put", str(good), "--nats", up)
    assert put.stdout.startswith("chats: 3 chat rows") and "assistant 3" in put.stdout
    shown = json.loads(jetlora("datasets", "show", "chats", "--nats", up, "--json").stdout)["dataset"]
    assert shown["stats"]["rows"] == 3 and shown["size"] == good.stat().st_size
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"model": "tiny", "base_dir": "/models/tiny", "dataset": {"name": "chats"}}))
    job = jetlora("submit", str(job_file), "--nats", up).stdout.strip()
    assert "succeeded" in jetlora("watch", job, "--nats", up).stdout
    out = tmp_path / "back.jsonl"
    assert "verified" in jetlora("datasets", "get", "chats", "-o", str(out), "--nats", up).stdout
    assert out.read_bytes() == good.read_bytes()
    assert jetlora("datasets", "rm", "chats", "--nats", up).stdout.strip() == "deleted chats"
    r = jetlora("datasets", "show", "chats", "--nats", up, check=False)
    assert r.returncode == 1 and "no dataset named chats" in r.stderr
