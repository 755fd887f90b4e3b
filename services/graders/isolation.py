"""How a sandbox process is started: the command lines that isolate it or, less, contain it, and what this machine
allows.

Isolated (Linux with util-linux's unshare/setpriv/prlimit): new network, mount, pid, IPC and UTS namespaces; inside,
a read-only tmpfs root holding only /usr, the library directories, the Python installation, /etc/ld.so.cache,
/dev/{null,zero,random,urandom}, a /proc of its own pid namespace and a SCRATCH_MIB tmpfs as /sandbox (its working
directory, the runner copied in); chroot into it (exec'd: the runner becomes the pid namespace's first process,
which nothing inside can signal and whose exit ends every process there), then an empty environment, then no
privilege: as root, a uid and gid of its own (no groups); as any other user, in a user namespace of its own (its
root mapped to the service's uid), every capability dropped from every set; no_new_privs either way, so no setuid;
then rlimits, then `python -I -S`. Every sandbox command first joins its cgroup (cgroups.py): the shell that starts
it writes its own pid there before it execs anything else.

Unisolated, which an operator must turn on (python_graders="on") where isolation fails: the service's own user, its
files and network, but in a pid namespace with a /proc of its own where one can be made (so it sees no process of
the service's and none of its processes outlives the sandbox's first), else held by its cgroup alone, the service
then made non-dumpable so that its /proc files are closed to a process of its uid."""

from __future__ import annotations

import ctypes
import functools
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
cp "$H/runner.py" "$H/worker.py" "$H/syscalls.py" "$R/sandbox/"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
mount -o remount,ro,bind "$R"
exec chroot "$R" "$@"
"""
    % SCRATCH_MIB
)

JOIN_SH = (  # the shell's own PWD is not passed on: the sandbox's environment stays empty
    'n="$1"; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n - 1)); done; '
    'unset PWD OLDPWD; exec "$@"'
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
    """Why this machine cannot isolate a sandbox as described above; "" where it may (the probe then decides)."""
    if not sys.platform.startswith("linux"):
        return f"namespaces are Linux's; this is {sys.platform}"
    if tools() is None:
        return "util-linux's unshare, setpriv and prlimit are not all installed"
    return ""


def as_root() -> bool:
    """Whether sandboxes are made by root (a uid of their own) rather than in a user namespace."""
    return os.geteuid() == 0


def joined(procs_files: list[str], command: list[str]) -> list[str]:
    """`command`, started by a shell that first joins the cgroup (writes its pid into each of `procs_files`)."""
    return ["/bin/sh", "-c", JOIN_SH, "join", str(len(procs_files)), *procs_files, *command]


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


def limits_prefix(prlimit: str, ctx: GraderContext, nproc: bool) -> list[str]:
    """prlimit's arguments: memory, processes (only where the uid is the sandbox's own), file size, open files, no
    core dumps. No CPU limit: the runner's CPU is what the grader makes it spend reading, and a limit on it was the
    grader's way to have it killed (the worker sets its own, worker.py)."""
    args = [
        prlimit,
        f"--as={ctx.memory_mib * 2**20}",
        f"--fsize={FILE_MIB * 2**20}",
        f"--nofile={OPEN_FILES}",
        "--core=0",
    ]
    if nproc:
        args.append(f"--nproc={ctx.max_processes}")
    return [*args, "--"]


def _unprivileged(setpriv: str) -> list[str]:
    """setpriv's arguments for a process that is root in a user namespace of its own: no capability left in any
    set (so none comes back at exec), no_new_privs."""
    return [setpriv, "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def isolated_command(root: str, home: str, uid: int | None, ctx: GraderContext) -> list[str]:
    """The full command: namespaces, the chroot built by SETUP_SH, the uid (`uid`, as root) or a user namespace
    with no capability (None), the limits, the runner."""
    t = tools() or {}
    binds = _binds()
    if uid is not None:
        who = [t["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]
        user = []
    else:
        who, user = _unprivileged(t["setpriv"]), ["--user", "--map-root-user"]
    inner = [
        t["env"],
        "-i",  # nothing of the shell's (PWD) either
        *who,
        *limits_prefix(t["prlimit"], ctx, nproc=uid is not None),
        python_binary(),
        "-I",
        "-S",
        "/sandbox/runner.py",
    ]
    namespaces = [*user, "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    setup = [root, home, str(uid or 0), str(len(binds)), *binds]
    return [t["unshare"], *namespaces, "--", "/bin/sh", "-c", SETUP_SH, "sandbox", *setup, *inner]


def pid_namespace_command() -> list[str]:
    """unshare's arguments for a pid namespace with a /proc of its own (a user namespace first where not root)."""
    t = tools() or {}
    user = [] if as_root() else ["--user", "--map-root-user"]
    return [t.get("unshare", "unshare"), *user, "--pid", "--fork", "--kill-child", "--mount-proc", "--"]


@functools.lru_cache(maxsize=1)
def hide_service() -> bool:
    """Make this service non-dumpable (prctl PR_SET_DUMPABLE 0), so that a process of its uid cannot open its
    /proc/<pid>/environ, mem or fds: for an unisolated grader with no /proc of its own. False where it could not be."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def unisolated_command(home: str, ctx: GraderContext, pid_namespace: bool) -> list[str]:
    """Unisolated, for an operator who turned python graders on where isolation fails: the service's own uid,
    its own files readable, the network reachable; an empty environment, the scratch dir, the limits, and where
    `pid_namespace`, a pid namespace and /proc of its own (no capability left in it where it is a user namespace's)."""
    t = tools() or {}
    prlimit = t.get("prlimit") or shutil.which("prlimit")
    prefix = limits_prefix(prlimit, ctx, nproc=False) if prlimit else []
    runner = [*prefix, python_binary(), "-I", "-S", os.path.join(home, "runner.py")]
    if not pid_namespace:
        return runner
    drop = [] if as_root() else _unprivileged(t["setpriv"])
    return [*pid_namespace_command(), *drop, *runner]
