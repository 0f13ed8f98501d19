"""Lets the training account's py-spy read the stacks of a launch's own processes where Yama allows a
debugger only over descendants (kernel.yama.ptrace_scope = 1, Ubuntu's default).

At a stall the launcher's node helper (node_ctl's `states`, as the training user) runs py-spy on each
rank to see where it waits. py-spy attaches with ptrace; with ptrace_scope 1 the kernel refuses a
process that is not the tracer's descendant, and node_ctl (started over SSH) is no rank's ancestor.
trainer_env's .pth file in the training venv calls `allow_stack_reads()` at every start of the venv's
python: a process of a launch (it carries the launch's tag, CLUSTERTRAIN_LAUNCH_ID, which run.sh
exports) declares with prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) that a debugger of its own account
may attach, which is what ptrace_scope 0 allows everywhere. Nothing more: root gets no new access (it
had it), another account still cannot attach (the kernel's same-account check stays), no binary gets
CAP_SYS_PTRACE and the system's ptrace_scope is left as it is. A process outside a launch (any other
use of the venv) is left alone, and with ptrace_scope 2 (admin only) or 3 (none) nothing is asked:
the launcher's report says the stacks could not be read.

Imports nothing beyond `os` unless it acts: this runs at every start of the venv's python.
"""

from __future__ import annotations

import os

#: The variable run.sh exports to every process of a launch (node_ctl.TAG_VARIABLE).
TAG_VARIABLE = "CLUSTERTRAIN_LAUNCH_ID"
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
#: prctl(2): PR_SET_PTRACER ("Yama"), and its argument for "any process of my account".
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = (1 << 64) - 1


def ptrace_scope(path: str = YAMA_SCOPE) -> int | None:
    """Yama's ptrace_scope (0-3), or None where the kernel has no Yama (every debugger of the same
    account may attach)."""
    try:
        with open(path) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


def allow_stack_reads(environ: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """In a launch's process under ptrace_scope 1: let a debugger of this account attach (prctl).
    Whether it was asked and granted; never raises (a failure here must not stop a rank's start)."""
    environ = os.environ if environ is None else environ
    if not environ.get(TAG_VARIABLE) or ptrace_scope() != 1:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc prctl (not Linux): nothing to allow
        return False
