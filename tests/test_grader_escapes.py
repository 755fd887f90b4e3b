"""What a hostile tenant's python grader tried against the real sandbox (#66), each contained: one memory and CPU bound
for all of a sandbox's processes, kernel interfaces it has no use for refused (a test per family), nothing left
running after its call (a setsid double fork included), the service's environment out of reach, and result lines
that would crash the supervisor scored as the grader's own error. Real sandboxes, isolated and unisolated (the
unisolated mode an operator may turn on where isolation fails); skipped, saying why, where this machine has none.
tests/test_grader_unprivileged.py runs the same escapes through a service that is not root."""

from __future__ import annotations

import os
import platform
import resource
import signal
import time

import pytest

from schemas.graders import GradeResult, PythonGrader, Sample
from services.graders import GraderContext, grade_many, status
from services.graders.blocking import run as run_blocking
from services.graders.sandbox import _call_deadline, _session

pytestmark = pytest.mark.skipif(not status().isolated, reason=f"no sandbox here: {status().why_not}")
CTX = GraderContext(wall_s=10.0, cpu_s=10.0, memory_mib=256, max_processes=8)
RUNTIME = "python_grader_runtime_error"

# Four children each touching 200 MiB and holding it until the parent has counted: how many held theirs at once.
MEMORY = r"""
import os, select, time
def grade(sample, item):
    r, w = os.pipe()
    release_r, release_w = os.pipe()
    pids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.close(release_w)
            block = bytearray(200 * 2**20)
            for k in range(0, len(block), 4096):
                block[k] = 1
            os.write(w, b'%d\n' % os.getpid())
            os.read(release_r, 1)
            os._exit(0)
        pids.append(pid)
    os.close(w)
    os.close(release_r)
    reported, buf, deadline = set(), b'', time.monotonic() + 5
    while len(reported) < 4 and time.monotonic() < deadline:
        if select.select([r], [], [], 0.1)[0]:
            chunk = os.read(r, 256)
            if not chunk:
                break
            *lines, buf = (buf + chunk).split(b'\n')
            reported.update(int(x) for x in lines)
    time.sleep(0.3)  # a child being killed has time to be gone
    dead = {pid for pid in pids if os.waitpid(pid, os.WNOHANG)[0]}
    os.close(release_w)
    return float(len(reported - dead))
"""

# Each family of system calls the sandbox refuses, called with arguments the kernel itself would take (or reject
# with another errno than EPERM), so that only the sandbox's filter answers EPERM. x86_64 numbers.
SYSCALLS = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    got = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return 0 if got >= 0 else ctypes.get_errno()
PARAMS = ctypes.create_string_buffer(120)
FAMILIES = {
    'keyring': lambda: [call(248, b'user', b'jetlora', b'x', 1, -2), call(250, 0, -3, 0), call(249, b'user', b'no', None, 0)],
    'io_uring': lambda: [call(425, 1, PARAMS), call(426, -1, 0, 0, 0, None, 0), call(427, -1, 0, None, 0)],
    'bpf': lambda: [call(321, 9999, None, 0)],
    'perf_event_open': lambda: [call(298, None, 0, -1, -1, 0)],
    'userfaultfd': lambda: [call(323, 1)],
    'ptrace': lambda: [call(101, 0, 0, 0, 0), call(310, os.getpid(), None, 0, None, 0, 0)],
    'mount': lambda: [call(165, None, None, None, 0, None), call(166, b'/nonexistent', 0), call(430, b'tmpfs', 0)],
    'unshare': lambda: [call(272, 0)],
    'setns': lambda: [call(308, -1, 0)],
}
def grade(sample, item):
    found = FAMILIES[sample['output_text']]()
    if all(e == 1 for e in found):
        return 1.0
    raise RuntimeError(f'not refused with EPERM: errnos {found}')
"""

# A child that starts a session of its own and forks again: the grandchild names itself, closes every descriptor it
# inherited (so that nothing waits for it) and lives on, to be found.
DOUBLE_FORK = r"""
import ctypes, os, time
def grade(sample, item):
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b'%s'), 0, 0, 0)
            os.write(w, b'x')
            os.closerange(0, 256)  # as a daemon does: nothing of the sandbox's held open, the call free to return
            time.sleep(5)
        os._exit(0)
    os.read(r, 1)
    return 1.0
"""

# Every environment block /proc shows it, its parent's first: how many held a variable.
ENVIRON = r"""
import os
def grade(sample, item):
    pids = [str(os.getppid())] + [p for p in os.listdir('/proc') if p.isdigit()]
    held = 0
    for pid in pids:
        try:
            with open(f'/proc/{pid}/environ', 'rb') as f:
                held += b'=' in f.read()
        except OSError:
            pass
    return float(held)
"""

# A result line written straight into the worker's pipe to the supervisor (one of its open descriptors).
FORGED_LINE = r"""
import os
LINE = %r
def grade(sample, item):
    for fd in range(3, 64):
        try:
            os.write(fd, LINE)
        except OSError:
            pass
    return 1.0
"""

# Two children spinning for a second: the CPU time they got over the wall-clock time it took.
SPIN = r"""
import os, time
def grade(sample, item):
    started = time.monotonic()
    for _ in range(2):
        if os.fork() == 0:
            while time.monotonic() - started < 1.0:
                pass
            os._exit(0)
    for _ in range(2):
        os.wait()
    return os.times().children_user / (time.monotonic() - started)
"""


def graded(source: str, outputs: list[str] | None = None) -> list[GradeResult]:
    outputs = outputs or ["x"]
    samples = [Sample.from_model_sample(o) for o in outputs]
    return grade_many(PythonGrader(name="p", source=source), samples, [{} for _ in outputs], CTX)


def unisolated(source: str) -> GradeResult:
    """One sample through the unisolated mode, as `--python-graders on` runs it where isolation fails."""
    out = run_blocking(_session(source, [(0, {"output_text": "x"}, {})], CTX, False, _call_deadline(CTX, 1, None)))
    assert out.ready, out
    return out.results[0]


def named(marker: str) -> list[int]:
    """Processes of this machine named `marker` that are not yet dead."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                name, state = f.read().split("(", 1)[1].rsplit(")", 1)
        except OSError:
            continue
        if name == marker and state.split()[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def test_forked_children_share_one_memory_bound():
    [result] = graded(MEMORY)
    assert result.score <= 1.0, f"{result.score:g} children held 200 MiB at once against memory_mib=256: {result}"


@pytest.fixture(scope="module")
def refusals() -> dict[str, GradeResult]:
    families = ["keyring", "io_uring", "bpf", "perf_event_open", "userfaultfd", "ptrace", "mount", "unshare", "setns"]
    return dict(zip(families, graded(SYSCALLS, families), strict=True))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the test calls system calls by their x86_64 numbers")
@pytest.mark.parametrize(
    "family", ["keyring", "io_uring", "bpf", "perf_event_open", "userfaultfd", "ptrace", "mount", "unshare", "setns"]
)
def test_a_system_call_family_is_refused(refusals, family):
    result = refusals[family]
    assert result.score == 1.0 and result.error == "", f"{family}: {result}"  # each call: EPERM


@pytest.mark.parametrize("mode", ["isolated", "unisolated"])
def test_a_setsid_double_fork_dies_with_its_call(mode):
    marker = f"jlx{os.getpid() % 10**6}{mode[0]}"
    source = DOUBLE_FORK % marker
    try:
        result = graded(source)[0] if mode == "isolated" else unisolated(source)
        assert result.score == 1.0, result  # the grandchild had named itself before the call returned
        deadline = time.monotonic() + 1.0  # the kernel's time to finish a kill already sent
        while named(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert named(marker) == [], f"the grader's grandchild outlived its call ({mode})"
    finally:
        for pid in named(marker):
            os.kill(pid, signal.SIGKILL)


def test_the_unisolated_mode_never_sees_an_environment():
    result = unisolated(ENVIRON)
    assert result.error == "" and result.score == 0.0, f"{result.score:g} environments readable: {result}"


@pytest.mark.parametrize(
    "line,says",
    [
        (b'{"i": 0, "score": 1' + b"0" * 400 + b"}\n", "finite number"),
        (b'{"i": 0, "score": ' + b"[" * 20000 + b"]" * 20000 + b"}\n", "nested"),
    ],
    ids=["huge-int", "deep-nesting"],
)
def test_a_hostile_result_line_is_the_graders_own_error(line, says):
    [result] = graded(FORGED_LINE % line)
    assert result.score == 0.0 and result.error_kind == RUNTIME and says in result.error, result


def test_the_cpu_quota_holds_for_all_of_a_sandboxs_processes():
    [result] = graded(SPIN)
    assert result.error == "" and result.score <= 1.2, f"two children got {result.score:.2f} CPUs: {result}"


# Ends its own process by a real-time signal (one with no name in Python's Signals), loading or grading.
RT_SIGNAL_GRADE = "import os, signal\ndef grade(sample, item):\n    os.kill(os.getpid(), signal.SIGRTMIN + 6)\n"
RT_SIGNAL_LOAD = (
    "import os, signal\nos.kill(os.getpid(), signal.SIGRTMIN + 6)\ndef grade(sample, item):\n    return 1.0\n"
)
# An error whose text holds a lone surrogate: JSON can escape it, UTF-8 cannot hold it.
SURROGATE_GRADE = "def grade(sample, item):\n    raise ValueError('\\ud800')\n"
SURROGATE_LOAD = "raise ValueError('\\udfff')\ndef grade(sample, item):\n    return 1.0\n"


@pytest.mark.parametrize(
    "source,says",
    [
        (RT_SIGNAL_GRADE, "signal"),
        (RT_SIGNAL_LOAD, "signal"),
        (SURROGATE_GRADE, "ValueError"),
        (SURROGATE_LOAD, "ValueError"),
    ],
    ids=["rt-signal", "rt-signal-at-load", "surrogate", "surrogate-at-load"],
)
def test_an_odd_end_or_error_is_the_graders_own(source, says):
    [result] = graded(source)
    assert result.score == 0.0 and result.error_kind == RUNTIME and says in result.error, result
    result.error.encode()  # text any JSON reader and writer downstream takes


# Writes to its stderr and stdout as fast as it can for 2 s: the GiB it wrote.
FLOOD = r"""
import os, sys, time
def grade(sample, item):
    block, written, started = b'x' * 65536, 0, time.monotonic()
    while time.monotonic() - started < 2.0:
        written += os.write(2, block) + os.write(1, block)
    return written / 2**30
"""


def test_what_a_grader_prints_costs_the_service_nothing():
    """The sandbox's CPU quota bounds its processes; what they print must not make the service's own process spend
    a core reading it (it did: ~1 CPU-second a second, 4 GiB read and dropped but for the last 4 KiB)."""
    started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    [result] = graded(FLOOD)
    after, took = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
    spent = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert result.error == "" and result.score > 0, result
    assert spent < 0.2 * took, f"the service spent {spent:.2f} CPU-s over a {took:.2f} s call the grader flooded"


# A socket of each family a grader may reach: AF_VSOCK (the hypervisor's channel on a VM, which no network namespace
# holds on this kernel) and, taken as usual, the families its empty network namespace covers.
SOCKETS = r"""
import errno, socket
def grade(sample, item):
    [s.close() for s in socket.socketpair(socket.AF_UNIX)]
    socket.socket(socket.AF_INET).close()
    socket.socket(socket.AF_INET6).close()
    socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM).close()
    try:
        socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    except OSError as e:
        return 1.0 if e.errno == errno.EAFNOSUPPORT else float(e.errno)
    return 0.0
"""


@pytest.mark.skipif(not hasattr(__import__("socket"), "AF_VSOCK"), reason="this Python has no AF_VSOCK")
def test_a_socket_family_no_namespace_holds_is_refused():
    [result] = graded(SOCKETS)
    assert result.score == 1.0 and result.error == "", f"AF_VSOCK: {result}"


# Sets the runner's (pid 1's, its own uid's) CPU limit to nothing, then gives it lines to read.
LIMIT_RUNNER = r"""
import os, resource
def grade(sample, item):
    try:
        resource.prlimit(1, resource.RLIMIT_CPU, (0, 0))
    except PermissionError:
        return 1.0
    for _ in range(100000):
        for fd in range(3, 64):
            try:
                os.write(fd, b'{"noise": 1}\n')
            except OSError:
                pass
    return 0.0
"""


def test_the_runner_s_limits_are_out_of_the_grader_s_reach():
    [result] = graded(LIMIT_RUNNER)
    assert result.score == 1.0 and result.error == "", result  # killed by its new limit: the server's error, before


# Lines the runner must read and parse (JSON it ignores), as fast as it takes them, its own timers ignored, until the
# runner has spent the CPU given (or the time runs out: -1).
NOISE = r"""
import os, signal, time
LINE = b'[' + b'{"a": [1, 2.5, "x"]}, ' * 2500 + b'0]\n'
def runner_cpu():
    fields = open('/proc/1/stat').read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')
def grade(sample, item):
    signal.signal(signal.SIGPROF, signal.SIG_IGN)
    started = time.monotonic()
    while runner_cpu() < item['runner_cpu_s']:
        if time.monotonic() - started > 25:
            return -1.0
        for fd in range(3, 64):
            try:
                os.write(fd, LINE)
            except OSError:
                pass
    return 1.0
"""


def test_the_runner_outlasts_any_cpu_the_grader_makes_it_spend():
    """The runner was under the sandbox's per-process CPU limit (cpu_s a sample + 5 s), so a grader sending it noise
    to parse had the kernel end it: the server's error, 'the sandbox ended early'. Only the grader's processes are."""
    ctx = GraderContext(wall_s=30.0, cpu_s=0.01, memory_mib=256, max_processes=8)
    source = PythonGrader(name="p", source=NOISE)
    [result] = grade_many(source, [Sample.from_model_sample("x")], [{"runner_cpu_s": 5.5}], ctx)
    assert result.score == 1.0 and result.error == "", result
