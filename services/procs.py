"""Child processes that do not outlive the process that started them."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL):
    """A preexec_fn for subprocess: the kernel sends the child `sig` when its parent dies, even by SIGKILL.

    Linux only (prctl); elsewhere it returns None and the child is ended by the parent's own shutdown."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def set_parent_death_signal() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return set_parent_death_signal
