"""How a sandbox process is started: the command line that isolates it, and what this machine allows.

Isolated (Linux, the service running as root, util-linux's unshare/setpriv/prlimit present): new network, mount,
pid, IPC and UTS namespaces; inside, a read-only tmpfs root holding only /usr, the library directories, the
Python installation, /etc/ld.so.cache, /dev/{null,zero,random,urandom}, a /proc of its own pid namespace and a
SCRATCH_MIB tmpfs as /sandbox (its working directory, the runner copied in); chroot into it (exec'd: the runner
becomes the pid namespace's first process, which nothing inside can signal and whose exit ends every process
there), then an empty environment, then a uid and gid of its own (no groups, no_new_privs, so no capabilities and
no setuid), then rlimits, then `python -I -S`. Anywhere else only the unisolated fallback is
possible, which an operator must turn on (python_graders="on")."""

from __future__ import annotations

import os
import random
import shutil
import sys
import threading

from services.graders.context import GraderContext

UID_BASE, UID_SPAN = 2_000_000_000, 1 << 24  # uids no file on the machine belongs to; one per sandbox
FILE_MIB = 64  # the most a grader may write into a file
SCRATCH_MIB = 64  # its scratch directory: a tmpfs of this size, so a grader cannot fill the service's disk
OPEN_FILES = 64
PROBE_SOURCE = "def grade(sample, item):\n    return 1.0\n"

SETUP_SH = (
    r"""
set -eu
SCRATCH_MIB=%d
PATH=/usr/sbin:/usr/bin:/sbin:/bin
R="$1"; H="$2"; U="$3"; N="$4"; shift 4
mount -t tmpfs -o mode=755,size=1m,nosuid,nodev jetlora-sandbox "$R"
for d in bin sbin lib lib32 lib64 libx32; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$R/$d"
  elif [ -d "/$d" ]; then mkdir "$R/$d"; mount --bind -o ro,nosuid,nodev "/$d" "$R/$d"; fi
done
mkdir -p "$R/usr" "$R/sandbox" "$R/proc" "$R/dev" "$R/etc"
mount --rbind -o ro,nosuid,nodev /usr "$R/usr"
while [ "$N" -gt 0 ]; do
  mkdir -p "$R$1"; mount --bind -o ro,nosuid,nodev "$1" "$R$1"; shift; N=$((N - 1))
done
if [ -f /etc/ld.so.cache ]; then touch "$R/etc/ld.so.cache"; mount --bind -o ro /etc/ld.so.cache "$R/etc/ld.so.cache"; fi
for n in null zero random urandom; do touch "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
mount -t tmpfs -o "size=${SCRATCH_MIB}m,mode=700,uid=$U,gid=$U,nosuid,nodev" jetlora-scratch "$R/sandbox"
cp "$H/runner.py" "$R/sandbox/runner.py"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
mount -o remount,ro,bind "$R"
exec chroot "$R" "$@"
"""
    % SCRATCH_MIB
)

_taken: set[int] = set()
_lock = threading.Lock()


def python_binary() -> str:
    return os.path.realpath(sys.executable)


def tools() -> dict[str, str] | None:
    """The binaries isolation needs, or None where one is missing (or this is not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    names = ("unshare", "setpriv", "prlimit", "env")
    found = {name: shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin") for name in names}
    return None if None in found.values() else {k: v for k, v in found.items() if v}


def why_not_isolated() -> str:
    """Why this machine cannot isolate a sandbox as described above; "" where it can (the probe then decides)."""
    if not sys.platform.startswith("linux"):
        return f"namespaces are Linux's; this is {sys.platform}"
    if tools() is None:
        return "util-linux's unshare, setpriv and prlimit are not all installed"
    if os.geteuid() != 0:
        return "the service does not run as root, so a grader cannot be given a uid of its own or a root of its own"
    return ""


def take_uid() -> int:
    with _lock:
        while True:
            uid = UID_BASE + random.randrange(UID_SPAN)
            if uid not in _taken:
                _taken.add(uid)
                return uid


def give_uid(uid: int) -> None:
    with _lock:
        _taken.discard(uid)


def _binds() -> list[str]:
    """Directories outside /usr the interpreter needs (a pyenv or /opt Python), bound read-only at their paths."""
    out: list[str] = []
    for path in (os.path.realpath(sys.base_prefix), os.path.dirname(python_binary())):
        if not path.startswith("/usr/") and not any(path == b or path.startswith(b + "/") for b in out):
            out.append(path)
    return out


def limits_prefix(prlimit: str, ctx: GraderContext, cases: int, nproc: bool) -> list[str]:
    """prlimit's arguments: memory, CPU for the whole process (a backstop to the runner's per-sample timer),
    processes (only where the uid is the sandbox's own), file size, open files, no core dumps."""
    cpu = int(ctx.cpu_s * max(cases, 1) + 5)
    args = [
        prlimit,
        f"--as={ctx.memory_mib * 2**20}",
        f"--cpu={cpu}",
        f"--fsize={FILE_MIB * 2**20}",
        f"--nofile={OPEN_FILES}",
        "--core=0",
    ]
    if nproc:
        args.append(f"--nproc={ctx.max_processes}")
    return [*args, "--"]


def isolated_command(root: str, home: str, uid: int, ctx: GraderContext, cases: int) -> list[str]:
    """The full command: namespaces, the chroot built by SETUP_SH, the uid, the limits, the runner."""
    t = tools() or {}
    binds = _binds()
    inner = [
        t["env"],
        "-i",  # nothing of the shell's (PWD) either
        t["setpriv"],
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--no-new-privs",
        "--",
        *limits_prefix(t["prlimit"], ctx, cases, nproc=True),
        python_binary(),
        "-I",
        "-S",
        "/sandbox/runner.py",
    ]
    namespaces = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    return [
        t["unshare"],
        *namespaces,
        "--",
        "/bin/sh",
        "-c",
        SETUP_SH,
        "sandbox",
        root,
        home,
        str(uid),
        str(len(binds)),
        *binds,
        *inner,
    ]


def fallback_command(home: str, ctx: GraderContext, cases: int) -> list[str]:
    """Unisolated, for an operator who turned python graders on where isolation fails: the service's own uid,
    its own files readable, the network reachable; only the limits, an empty environment and the scratch dir."""
    prlimit = shutil.which("prlimit")
    prefix = limits_prefix(prlimit, ctx, cases, nproc=False) if prlimit else []
    return [*prefix, python_binary(), "-I", "-S", os.path.join(home, "runner.py")]
