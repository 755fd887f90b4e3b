"""Python graders on a node as shipped (#66): the agent runs as an unprivileged user (deploy/systemd's User=vllm,
with Delegate=yes), so the sandbox isolates without root, in a user namespace of its own, bounded by a cgroup in the
subtree delegated to the service. Here a service process runs as `nobody` in a cgroup delegated to it as systemd
delegates one (the directory and its cgroup.procs its own), and the escapes of tests/test_grader_escapes.py are
tried through it; then the same user without a delegated cgroup, which must refuse to isolate, saying why.
Skipped, saying why, where this machine cannot make such a user's process (not root, no interpreter it may run)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.graders import cgroups, isolation
from tests.test_grader_escapes import DOUBLE_FORK, ENVIRON, MEMORY, named

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
SITE = next(p for p in sys.path if p.endswith("site-packages"))
KEYRING = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "def grade(sample, item):\n"
    "    got = libc.syscall(248, b'user', b'jetlora', b'x', 1, -2)\n"
    "    return float(ctypes.get_errno()) if got < 0 else 0.0\n"
)
# In its user namespace the grader is root (with no capability) and the supervisor's /proc files, non-dumpable, are
# that root's: it offers the supervisor to the kernel's OOM killer, then passes the sandbox's memory limit.
OFFER_SUPERVISOR = r"""
import os, time
def grade(sample, item):
    with open('/proc/1/oom_score_adj', 'w') as f:
        f.write('1000')
    pids = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            block = bytearray(120 * 2**20)
            for k in range(0, len(block), 4096):
                block[k] = 1
            time.sleep(5)
            os._exit(0)
        pids.append(pid)
    if any(os.WIFSIGNALED(os.waitpid(pid, 0)[1]) for pid in pids):
        raise MemoryError('the kernel ended a child of the grader')
    return 1.0
"""
SERVICE = r"""
import json, sys
spec = json.load(sys.stdin)
sys.path[:0] = spec["path"]
from schemas.graders import PythonGrader, Sample
from services.graders import GraderContext, grade_many, status
from services.graders.blocking import run
from services.graders.sandbox import _call_deadline, _session, refusal
found = status()
ctx = GraderContext(wall_s=10.0, cpu_s=10.0, memory_mib=256)
out = {"status": [found.isolated, found.why_not, found.bound, found.unisolated]}
out["on"] = refusal(GraderContext(python_graders="on"))
from services.cli.grader_flags import checked
from services.runtime import StartupError
try:
    checked(GraderContext(python_graders="on", command="jetlora agent"))  # as the agent starts
    out["start"] = ""
except StartupError as e:
    out["start"] = str(e)
out["on, single tenant"] = refusal(GraderContext(python_graders="on", single_tenant=True))
for name, source in spec["isolated"].items() if found.isolated else ():
    [r] = grade_many(PythonGrader(name="p", source=source), [Sample.from_model_sample("x")], [{}], ctx)
    out[name] = [r.score, r.error]
    out[name + ":kind"] = r.error_kind
for name, source in spec["unisolated"].items() if found.unisolated else ():
    got = run(_session(source, [(0, {"output_text": "x"}, {})], ctx, False, _call_deadline(ctx, 1, None)))
    out[name] = [got.results[0].score, got.results[0].error] if 0 in got.results else [None, got.ended]
print(json.dumps(out))
"""


@functools.cache
def interpreter() -> str | None:
    """A Python of this one's version that `nobody` may run and reach (this one, or the system's: the sandbox binds
    its installation), to run with this one's packages."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    reach = "import os, sys; os.stat(sys.base_prefix); os.stat(os.path.realpath(sys.executable))"
    for candidate in (os.path.realpath(sys.executable), shutil.which(version, path="/usr/bin:/bin")):
        if candidate and subprocess.run(as_nobody([candidate, "-c", reach]), capture_output=True).returncode == 0:
            return candidate
    return None


def as_nobody(command: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command]


@functools.cache
def why_skip() -> str:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "making another user's process and delegating it a cgroup needs root on Linux"
    if isolation.tools() is None:
        return "util-linux's unshare, setpriv and prlimit are not all installed"
    if not isinstance(cgroups.find(), cgroups.Pool):
        return f"this process has no cgroup to delegate from ({cgroups.find()})"
    if interpreter() is None:
        return f"no Python {sys.version_info.major}.{sys.version_info.minor} that user {NOBODY} may run"
    return ""


pytestmark = pytest.mark.skipif(bool(why_skip()), reason=why_skip() or "-")


def delegated() -> cgroups.Cgroup:
    """A cgroup given to `nobody` as systemd's Delegate=yes gives a service its own: the directories, and the files
    a delegate writes, owned by it."""
    pool = cgroups.find()
    assert isinstance(pool, cgroups.Pool)
    group = cgroups.Cgroup(pool.version, [])
    for parent in pool.parents:
        path = os.path.join(parent, f"jetlora-test-delegated-{os.getpid()}")
        os.mkdir(path)
        group.dirs.append(path)
        for name in ("", "cgroup.procs", "tasks", "cgroup.subtree_control", "cgroup.threads"):
            if os.path.exists(os.path.join(path, name)):
                os.chown(os.path.join(path, name), NOBODY, NOBODY)
    return group


def service(isolated: dict[str, str], unisolated: dict[str, str], group: cgroups.Cgroup | None) -> dict:
    """What a service running as `nobody` (in `group`, where given) finds and grades."""
    command = as_nobody([interpreter() or "", "-c", SERVICE])
    if group is not None:
        command = isolation.joined(group.procs_files(), command)
    spec = {"path": [str(ROOT), SITE], "isolated": isolated, "unisolated": unisolated}
    done = subprocess.run(command, input=json.dumps(spec), capture_output=True, text=True, timeout=120, env={})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def leave(group: cgroups.Cgroup) -> None:
    """The delegated cgroup and whatever its delegate made in it, removed (its processes ended first)."""
    for parent in group.dirs:
        for sub in sorted((p for p in Path(parent).rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            cgroups.Cgroup(group.version, [str(sub)]).kill()
            os.rmdir(sub)
    group.kill()
    group.remove()


def test_an_unprivileged_service_isolates_and_bounds_graders_in_its_delegated_cgroup():
    marker = f"jlu{os.getpid() % 10**6}"
    group = delegated()
    try:
        found = service(
            {"memory": MEMORY, "keyring": KEYRING, "double fork": DOUBLE_FORK % marker}, {"environment": ENVIRON}, group
        )
        assert named(marker) == [], "the grader's grandchild outlived its call"
    finally:
        for pid in named(marker):
            os.kill(pid, 9)
        leave(group)
    isolated, why, bound, contained = found["status"]
    assert isolated and bound.startswith("cgroup v") and contained, found
    assert found["memory"][0] <= 1.0, f"{found['memory']} children held 200 MiB at once against 256 MiB"
    assert found["keyring"] == [1.0, ""], found  # add_key: EPERM
    assert found["double fork"] == [1.0, ""], found
    assert found["environment"] == [0.0, ""], found  # unisolated: no environment it can read
    assert found["on"] == found["start"] == "", found  # isolated: nothing to refuse


def test_without_a_delegated_cgroup_it_refuses_to_isolate_saying_why():
    found = service({}, {"environment": ENVIRON}, None)
    isolated, why, bound, contained = found["status"]
    assert not isolated and "cgroup" in why and bound == "", found
    assert contained == "a pid namespace of its own", found  # its user namespace still gives it one
    assert "--single-tenant" in found["on"] and found["on, single tenant"] == "", found
    assert "jetlora agent --python-graders on --single-tenant" in found["start"], found  # it refuses to start
    assert found["environment"] == [0.0, ""], found


def test_a_grader_that_has_the_kernel_end_its_supervisor_gets_its_own_error():
    """Whichever process the OOM killer picks in a sandbox, the sandbox's own memory made it: the sample is the
    grader's error (it was python_grader_server_error, 'the sandbox ended early')."""
    group = delegated()
    try:
        found = service({"offer": OFFER_SUPERVISOR}, {}, group)
    finally:
        leave(group)
    assert found["offer"][0] == 0.0 and found["offer:kind"] == "python_grader_runtime_error", found
    assert "MiB" in found["offer"][1], found
