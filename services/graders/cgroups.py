"""One bound for all of a sandbox's processes, whatever they fork or however they detach: a cgroup of its own with a
memory limit (and no swap), a process limit and a CPU quota, made for each sandbox in a subtree this service may
write, and killed whole when the call ends.

cgroup v2 where the unified hierarchy has the memory, pids and cpu controllers: the service's own cgroup (delegated
to it: systemd's Delegate=yes, or root) becomes the parent of the sandboxes' cgroups, its own processes moved into a
leaf beside them (`jetlora-service`), as v2's no-internal-processes rule asks; a process started there later (the
agent's trainer) finds the parent one level up. Else cgroup v1, as a hybrid machine mounts it (the memory, pids and
cpu hierarchies apart), under the service's own cgroup in each. Else none, and find() says why."""

from __future__ import annotations

import itertools
import os
import signal
from dataclasses import dataclass

CONTROLLERS = ("memory", "pids", "cpu")
PERIOD_US = 100_000
LEAF = "jetlora-service"
PREFIX = "jetlora-grader-"
_names = itertools.count()


@dataclass(frozen=True)
class Limits:
    memory_mib: int  # all of the sandbox's processes together, its scratch tmpfs's pages included
    processes: int  # tasks: threads count
    cpus: float  # CPU time per wall-clock second


@dataclass
class Cgroup:
    """One sandbox's cgroup: a directory in each hierarchy (one under v2)."""

    version: int
    dirs: list[str]

    def procs_files(self) -> list[str]:
        """Where a process writes its pid to join (each hierarchy's)."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def pids(self) -> list[int]:
        try:
            with open(self.procs_files()[0]) as f:
                return [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            return []

    def kill(self) -> int:
        """SIGKILL to every process in it (v2's cgroup.kill where the kernel has it); how many were still there."""
        left = self.pids()
        if left and self.version == 2 and _write(os.path.join(self.dirs[0], "cgroup.kill"), "1"):
            return len(left)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return len(left)

    def oom_kills(self) -> int:
        """Processes the kernel ended for the memory limit (memory.events under v2, memory.oom_control under v1)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:  # the memory hierarchy's directory is the first
            with open(os.path.join(self.dirs[0], name)) as f:
                counts = dict(line.split() for line in f if len(line.split()) == 2)
            return int(counts.get("oom_kill", 0))
        except (OSError, ValueError):
            return 0

    def remove(self) -> bool:
        """The directories removed (False while a process is still in one)."""
        done = True
        for d in self.dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                done = False
        return done


@dataclass(frozen=True)
class Pool:
    """Where sandboxes' cgroups are made: one parent directory per hierarchy (v1), or one (v2)."""

    version: int
    parents: tuple[str, ...]

    def describe(self) -> str:
        return f"cgroup v{self.version} ({', '.join(CONTROLLERS)}) under {', '.join(self.parents)}"

    def make(self, limits: Limits) -> Cgroup:
        """A fresh cgroup with `limits` set (OSError where the kernel refuses one: nothing is left behind)."""
        name = f"{PREFIX}{os.getpid()}-{next(_names)}"
        group = Cgroup(self.version, [])
        try:
            for parent in self.parents:
                path = os.path.join(parent, name)
                os.mkdir(path)
                group.dirs.append(path)
            for path, values in zip(group.dirs, self._settings(limits), strict=True):
                for file, value in values:
                    if not _write(os.path.join(path, file), value) and not file.startswith(
                        ("memory.memsw", "memory.swap")
                    ):
                        raise OSError(f"cannot set {file} in {path}")
        except OSError:
            group.remove()
            raise
        return group

    def _settings(self, limits: Limits) -> list[list[tuple[str, str]]]:
        """Each directory's files and values, in the order they must be written."""
        memory = str(limits.memory_mib * 2**20)
        quota = str(max(1000, int(limits.cpus * PERIOD_US)))
        if self.version == 2:
            return [
                [
                    ("memory.max", memory),
                    ("memory.swap.max", "0"),
                    ("pids.max", str(limits.processes)),
                    ("cpu.max", f"{quota} {PERIOD_US}"),
                ]
            ]
        files = {
            "memory": [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
            "pids": [("pids.max", str(limits.processes))],
            "cpu": [("cpu.cfs_period_us", str(PERIOD_US)), ("cpu.cfs_quota_us", quota)],
        }
        return [files[controller] for controller in CONTROLLERS]


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root, mount point, super options) of each cgroup mount this process sees."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                out.append((tail[0], fields[3], fields[4].replace("\\040", " "), set(tail[2].split(","))))
    return out


def _own() -> dict[str, str]:
    """This process's cgroup in each hierarchy: "" for v2's, each v1 controller's name for its own."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _inside(mount_root: str, mount_point: str, path: str) -> str | None:
    """Where cgroup `path` is under a mount of `mount_root` (a container's mounts start below the root)."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    rel = path[len(mount_root) :] if mount_root != "/" else path
    return mount_point + rel.rstrip("/") if rel not in ("", "/") else mount_point


def _controllers(path: str, file: str) -> set[str]:
    try:
        with open(os.path.join(path, file)) as f:
            return set(f.read().split())
    except OSError:
        return set()


def _v2(mounts, own) -> Pool | str:
    unified = next((m for m in mounts if m[0] == "cgroup2"), None)
    if unified is None or "" not in own:
        return "no cgroup v2 hierarchy is mounted"
    here = _inside(unified[1], unified[2], own[""])
    if here is None or not set(CONTROLLERS) <= _controllers(here, "cgroup.controllers"):
        return f"cgroup v2 has not {', '.join(CONTROLLERS)} here"
    for candidate in (here, os.path.dirname(here)) if os.path.basename(here) == LEAF else (here,):
        if set(CONTROLLERS) <= _controllers(candidate, "cgroup.subtree_control") and os.access(candidate, os.W_OK):
            return Pool(2, (candidate,))
    if not os.access(here, os.W_OK) or not os.access(os.path.join(here, "cgroup.subtree_control"), os.W_OK):
        return f"this service may not write its cgroup {own['']} (its unit needs Delegate=yes)"
    leaf = os.path.join(here, LEAF)
    try:
        os.makedirs(leaf, exist_ok=True)
        with open(os.path.join(here, "cgroup.procs")) as f:
            for pid in f.read().split():
                if not _write(os.path.join(leaf, "cgroup.procs"), pid) and os.path.exists(f"/proc/{pid}"):
                    return f"cannot move process {pid} out of {own['']} into {LEAF}"
        if not _write(os.path.join(here, "cgroup.subtree_control"), " ".join(f"+{c}" for c in CONTROLLERS)):
            return f"cannot enable {', '.join(CONTROLLERS)} for the cgroups under {own['']}"
    except OSError as e:
        return f"cannot make a leaf for this service in {own['']}: {e.strerror}"
    return Pool(2, (here,))


def _v1(mounts, own) -> Pool | str:
    parents = []
    for controller in CONTROLLERS:
        mount = next((m for m in mounts if m[0] == "cgroup" and controller in m[3]), None)
        if mount is None or controller not in own:
            return f"no cgroup v1 {controller} hierarchy is mounted"
        here = _inside(mount[1], mount[2], own[controller])
        if here is None or not os.access(here, os.W_OK):
            return f"this service may not make cgroups under its own {controller} cgroup {own[controller]}"
        parents.append(here)
    return Pool(1, tuple(parents))


def find() -> Pool | str:
    """Where this service makes sandboxes' cgroups, or why it cannot: v2 where it has the controllers, else v1."""
    if not os.path.exists("/proc/self/cgroup"):
        return "this system has no cgroups"
    try:
        mounts, own = _mounts(), _own()
    except (OSError, ValueError) as e:
        return f"cannot read this process's cgroups ({e})"
    found = [_v2(mounts, own), _v1(mounts, own)]
    for pool in found:
        if isinstance(pool, Pool):
            try:  # the kernel must take a cgroup with its limits, not only a directory
                pool.make(Limits(64, 8, 1.0)).remove()
            except OSError as e:
                return f"cgroup v{pool.version}: {e}"
            return pool
    return f"no cgroup to bound a sandbox with ({found[0]}; {found[1]})"
