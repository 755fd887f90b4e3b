"""Python graders in the sandbox (services/graders/sandbox.py): what a hostile or broken grader tries, each scoring
0 with an error saying why, the test process unharmed; a correct grader scoring right, one process for a batch.
Skipped, saying why, where this machine cannot isolate a grader (not root on Linux)."""

from __future__ import annotations

import dataclasses
import os
import resource
import socket
import time

import pytest

from schemas.graders import PythonGrader, Sample
from services.graders import GraderContext, check, grade_many, status
from services.graders.sandbox import run_python

pytestmark = pytest.mark.skipif(not status().isolated, reason=f"no sandbox here: {status().why_not}")
CTX = GraderContext(wall_s=2.0, cpu_s=2.0, memory_mib=256, max_processes=8)


def run(source: str, outputs: list[str] | None = None, items: list | None = None, ctx: GraderContext = CTX):
    outputs = outputs or ["x"]
    samples = [Sample.from_model_sample(o) for o in outputs]
    return grade_many(PythonGrader(name="p", source=source), samples, items or [{} for _ in outputs], ctx)


def test_a_correct_grader_scores_right_all_samples_in_one_process():
    source = (
        "calls = 0\n"
        "def grade(sample, item):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    right = sample['output_json'] and sample['output_json']['answer'] == item['answer']\n"
        "    return (1.0 if right else 0.0) + calls / 1000\n"
    )
    outputs = ['{"answer": 4}', '{"answer": 5}', "four", '{"answer": 4}']
    results = run(source, outputs, [{"answer": 4}] * 4)
    assert [r.score for r in results] == [1.001, 0.002, 0.003, 1.004]  # the counter: one process for the batch
    assert all(r.error == "" for r in results)


def test_a_socket_to_a_listening_local_port_gets_no_connection():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    source = f"import socket\ndef grade(sample, item):\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    return 1.0\n"
    try:
        [result] = run(source)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    assert result.score == 0.0 and "no network" in result.error, result


def test_the_environment_of_the_service_is_not_there(monkeypatch):
    monkeypatch.setenv("JETLORA_GRADER_SECRET", "hunter2")
    [result] = run("import os\ndef grade(sample, item):\n    return float(len(os.environ['JETLORA_GRADER_SECRET']))\n")
    assert result.score == 0.0 and "KeyError: 'JETLORA_GRADER_SECRET'" in result.error, result
    [count] = run(
        "import os\ndef grade(sample, item):\n    return float(len([k for k in os.environ if k != 'LC_CTYPE']))\n"
    )
    assert count.score == 0.0 and count.error == ""  # nothing but what Python sets itself (its UTF-8 locale)


def test_a_private_file_outside_the_scratch_dir_cannot_be_read(tmp_path):
    secret = tmp_path / "credentials"
    secret.write_text("token")
    secret.chmod(0o600)
    source = f"def grade(sample, item):\n    return float(len(open({str(secret)!r}).read()))\n"
    [result] = run(source)
    assert result.score == 0.0 and ("FileNotFoundError" in result.error or "PermissionError" in result.error), result
    seen = "import os\ndef grade(sample, item):\n    return float(os.path.exists('/work') or os.listdir('/etc') != ['ld.so.cache'])\n"
    [root] = run(seen)
    assert root.score == 0.0 and root.error == ""  # a root of its own: no /work, an /etc with only the loader's cache
    [writes] = run(
        "def grade(sample, item):\n    open('mine.txt', 'w').write('ok')\n    return float(len(open('mine.txt').read()))\n"
    )
    assert writes.score == 2.0  # its own scratch dir is its to write


def test_forking_repeatedly_is_contained():
    source = "import os\ndef grade(sample, item):\n    while True:\n        os.fork()\n"
    started = time.monotonic()
    results = run(source, ["a", "b"])
    assert all(r.score == 0.0 and "allows 8 processes" in r.error for r in results), results
    assert time.monotonic() - started < 30


def test_a_grader_that_loops_forever_is_killed_at_the_wall_limit_and_the_next_samples_go_on():
    source = (
        "def grade(sample, item):\n"
        "    if sample['output_text'] == 'loop':\n"
        "        while True:\n"
        "            try:\n"
        "                while True:\n"
        "                    pass\n"
        "            except BaseException:\n"  # catches the runner's own timer: only the kill from outside ends it
        "                pass\n"
        "    return 0.5\n"
    )
    started = time.monotonic()
    results = run(source, ["ok", "loop", "ok"])
    took = time.monotonic() - started
    assert [r.score for r in results] == [0.5, 0.0, 0.5]
    assert "wall-clock limit of 2.0 s" in results[1].error and results[1].error_kind == "unresponsive_reward_error"
    assert took < 2.0 + 2.0 + 10, took


def test_ten_gib_is_refused_by_the_memory_limit():
    [result] = run("def grade(sample, item):\n    block = bytearray(10 * 2**30)\n    return 1.0\n")
    assert result.score == 0.0 and "MemoryError" in result.error and "256 MiB" in result.error, result


@pytest.mark.parametrize(
    "value,says", [("float('nan')", "finite"), ("float('inf')", "finite"), ("'0.9'", "must return a number")]
)
def test_a_grader_returning_no_finite_number_scores_0(value, says):
    [result] = run(f"def grade(sample, item):\n    return {value}\n")
    assert result.score == 0.0 and says in result.error, result


def test_errors_in_the_source_and_exits_are_reported_per_sample():
    [raised] = run("def grade(sample, item):\n    return 1 / 0\n")
    assert raised.score == 0.0 and "ZeroDivisionError" in raised.error and "line 2" in raised.error
    assert "does not load" in run("def grade(:\n")[0].error
    assert "no function grade" in run("x = 1\n")[0].error
    exits = run("import os\ndef grade(sample, item):\n    os._exit(3)\n", ["a", "b"])
    assert all("exit status 3" in r.error for r in exits)


def test_check_loads_the_source_in_the_sandbox():
    good = PythonGrader(name="p", source="def grade(sample, item):\n    return 1.0\n")
    assert check(good, "grader", CTX) == []
    [error] = check(PythonGrader(name="p", source="def grad(sample, item):\n    return 1.0\n"), "grader", CTX)
    assert error.field == "grader.source" and "grade(sample, item)" in error.reason


def test_the_test_process_stays_healthy(tmp_path):
    ctx = dataclasses.replace(CTX, scratch_dir=str(tmp_path))  # its own: other workers' graders run meanwhile
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run_python("def grade(sample, item):\n    return 1.0\n", [{"output_text": "x"}], [{}], ctx)
    assert os.getpid() > 0 and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000
    leftovers = [d for d in os.listdir(ctx.scratch()) if d.startswith("jetlora-grader-")]
    assert leftovers == [], leftovers


def test_the_scratch_dir_is_small_and_its_own():
    source = (
        "def grade(sample, item):\n"
        "    for k in range(8):\n"
        "        with open(f'f{k}', 'wb') as f:\n"
        "            f.write(bytes(16 * 2**20))\n"
        "    return 1.0\n"
    )
    [result] = run(source, ctx=GraderContext(wall_s=10.0, cpu_s=10.0, memory_mib=256))
    assert result.score == 0.0 and "No space left" in result.error, result  # 128 MiB into a 64 MiB tmpfs
    assert "jetlora-scratch" not in open("/proc/mounts").read()  # its mounts were the sandbox's alone
