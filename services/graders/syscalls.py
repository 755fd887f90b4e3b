"""The sandbox's system call filter: a seccomp program (classic BPF, loaded with prctl through ctypes, so no library
beyond the standard one) that refuses, with EPERM, what a grader has no use for and what reaches kernel state beyond
its call or its own processes. Standard library only: runner.py loads it inside the sandbox before the grader's
source is compiled; every process of the sandbox inherits it and no process can remove it.

Refused (by family): the kernel keyrings, io_uring, bpf, perf_event_open, userfaultfd, other processes' memory and
tracing (ptrace, process_vm_*, kcmp, pidfd_getfd), mounts, namespaces (unshare, setns, clone with a namespace flag;
clone3 answers ENOSYS, whose flags a filter cannot read, so the C library falls back to clone), and the machine's
own settings (modules, kexec, reboot, swap, clock, quota, accounting, the kernel log, file handles, port I/O,
personality, NUMA moves). A call of another ABI (i386's int 0x80, x32) is refused whatever it is. A socket (or
socket pair) of a family other than those the sandbox's network namespace holds (unix, inet, inet6, netlink) answers
EAFNOSUPPORT, as a kernel without that family would: AF_VSOCK, the channel to the hypervisor on a VM, belongs to no
network namespace here, nor do several others (AF_ALG, AF_BLUETOOTH, AF_RDS, ...) a grader has no use for.
prlimit64 on another process than the caller (pid 0) is refused: the runner has the grader's uid, and a grader that
set the runner's CPU limit to nothing had it killed, its sample read as the server's fault."""

from __future__ import annotations

import ctypes
import os

EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
NEW_PRIVS, SET_SECCOMP, MODE_FILTER = 38, 22, 2  # prctl's options
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_BIT = 0x40000000
NAMESPACE_FLAGS = 0x7E020080  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
CLONE = {"x86_64": 56, "aarch64": 220}
CLONE3 = 435
SOCKET = {"x86_64": (41, 53), "aarch64": (198, 199)}  # socket, socketpair
PRLIMIT = {"x86_64": 302, "aarch64": 261}
FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK: what a network namespace of its own holds

# name: (x86_64, aarch64); None where the architecture has no such call
DENIED: dict[str, dict[str, tuple[int | None, int | None]]] = {
    "keyring": {"add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219)},
    "io_uring": {"io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427)},
    "bpf": {"bpf": (321, 280)},
    "perf": {"perf_event_open": (298, 241)},
    "userfaultfd": {"userfaultfd": (323, 282)},
    "other processes": {
        "ptrace": (101, 117),
        "process_vm_readv": (310, 270),
        "process_vm_writev": (311, 271),
        "kcmp": (312, 272),
        "pidfd_getfd": (438, 438),
        "move_pages": (279, 239),
        "migrate_pages": (256, 238),
    },
    "mounts": {
        "mount": (165, 40),
        "umount2": (166, 39),
        "pivot_root": (155, 41),
        "chroot": (161, 51),
        "open_tree": (428, 428),
        "move_mount": (429, 429),
        "fsopen": (430, 430),
        "fsconfig": (431, 431),
        "fsmount": (432, 432),
        "fspick": (433, 433),
        "mount_setattr": (442, 442),
        "open_tree_attr": (467, 467),
    },
    "namespaces": {"unshare": (272, 97), "setns": (308, 268)},
    "the machine": {
        "kexec_load": (246, 104),
        "kexec_file_load": (320, 294),
        "init_module": (175, 105),
        "finit_module": (313, 273),
        "delete_module": (176, 106),
        "reboot": (169, 142),
        "swapon": (167, 224),
        "swapoff": (168, 225),
        "acct": (163, 89),
        "syslog": (103, 116),
        "quotactl": (179, 60),
        "quotactl_fd": (443, 443),
        "settimeofday": (164, 170),
        "clock_settime": (227, 112),
        "clock_adjtime": (305, 266),
        "adjtimex": (159, 171),
        "name_to_handle_at": (303, 264),
        "open_by_handle_at": (304, 265),
        "lookup_dcookie": (212, 18),
        "fanotify_init": (300, 262),
        "vhangup": (153, 58),
        "personality": (135, 92),
        "iopl": (172, None),
        "ioperm": (173, None),
        "uselib": (134, None),
    },
}

# classic BPF
LD_ABS_W, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
ALLOW, ERRNO = 0x7FFF0000, 0x00050000
NR_AT, ARCH_AT, ARG0_AT = 0, 4, 16  # offsets in struct seccomp_data (arg 0's low word: little-endian only)


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def denied(machine: str) -> list[int]:
    """The numbers of every refused call on `machine` (clone's and clone3's rules are apart)."""
    column = 0 if machine == "x86_64" else 1
    return [nr for family in DENIED.values() for nrs in family.values() if (nr := nrs[column]) is not None]


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for `machine` as (code, jt, jf, k) instructions: arch checked, then each refused number, then
    clone's flags, sockets' families and prlimit's pid; the verdicts at the end, jumped to."""
    body: list[tuple[int | str, int | str, int | str, int]] = [
        (LD_ABS_W, 0, 0, ARCH_AT),
        (JEQ, 0, "refuse", AUDIT_ARCH[machine]),
        (LD_ABS_W, 0, 0, NR_AT),
    ]
    if machine == "x86_64":
        body.append((JGE, "refuse", 0, X32_BIT))
    body += [(JEQ, "clone", 0, CLONE[machine]), (JEQ, "enosys", 0, CLONE3)]
    body += [(JEQ, "socket", 0, nr) for nr in SOCKET[machine]]
    body.append((JEQ, "prlimit", 0, PRLIMIT[machine]))
    body += [(JEQ, "refuse", 0, nr) for nr in denied(machine)]
    body += [
        (RET, 0, 0, ALLOW),
        ("clone", 0, 0, 0),  # a label: the next instruction's
        (LD_ABS_W, 0, 0, ARG0_AT),
        (JSET, "refuse", 0, NAMESPACE_FLAGS),
        (RET, 0, 0, ALLOW),
        ("socket", 0, 0, 0),
        (LD_ABS_W, 0, 0, ARG0_AT),
        *[(JEQ, "allow", 0, family) for family in FAMILIES],
        (RET, 0, 0, ERRNO | EAFNOSUPPORT),
        ("prlimit", 0, 0, 0),
        (LD_ABS_W, 0, 0, ARG0_AT),
        (JEQ, "allow", "refuse", 0),  # pid 0: the caller's own limits
        ("allow", 0, 0, 0),
        (RET, 0, 0, ALLOW),
        ("refuse", 0, 0, 0),
        (RET, 0, 0, ERRNO | EPERM),
        ("enosys", 0, 0, 0),
        (RET, 0, 0, ERRNO | ENOSYS),
    ]
    labels: dict[str, int] = {}
    code: list[tuple[int, int | str, int | str, int]] = []
    for head, jt, jf, k in body:
        if isinstance(head, str):
            labels[head] = len(code)
        else:
            code.append((head, jt, jf, k))
    out = []
    for pc, (op, jt, jf, k) in enumerate(code):
        jumps = [labels[j] - pc - 1 if isinstance(j, str) else j for j in (jt, jf)]
        assert all(0 <= j <= 255 for j in jumps), "a jump past classic BPF's reach"
        out.append((op, jumps[0], jumps[1], k))
    return out


def apply() -> bool:
    """Load the filter into this process (no_new_privs first, as an unprivileged process must); False where this
    architecture is not one it knows or the kernel refused it."""
    machine = os.uname().machine
    if machine not in AUDIT_ARCH:
        return False
    code = program(machine)
    filters = (_Filter * len(code))(*[_Filter(*op) for op in code])
    prog = _Program(len(code), filters)
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if prctl(NEW_PRIVS, 1, None, 0, 0) != 0:
        return False
    return prctl(SET_SECCOMP, MODE_FILTER, ctypes.cast(ctypes.byref(prog), ctypes.c_void_p), 0, 0) == 0
