"""A mount that never answers: what a home on an NFS server that stopped answering looks like to root.

A FUSE mount whose server process never reads its `/dev/fuse` (so it never answers even the kernel's
first request): every lookup, stat or open under it blocks in the kernel, as on a hard NFS mount
whose server is gone, until the connection is closed. No FUSE library or daemon is needed: the
file descriptor the kernel hands requests to is simply held open and never read. The waits are
killable, so a process blocked on the mount can still be ended.

`hung_mount(path)` mounts it here (the test machine, as root); `hung_mount_in(pid, path)` in the mount
namespace of another process (a test-bed container's init, entered with nsenter from the host, whose
/dev/fuse is opened on the host so the container needs neither the device nor CAP_SYS_ADMIN).
Leaving either closes the connection (the blocked calls fail with ENOTCONN) and unmounts.

Imported by tests (`from helpers.hung_mount import ...`); it imports no test module.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator

#: The options of a FUSE mount made without fusermount: owner root, a directory at its root.
OPTIONS = "rootmode=40000,user_id=0,group_id=0"
MNT_DETACH = 2


@contextlib.contextmanager
def hung_mount(path: str) -> Iterator[str]:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        data = f"fd={fd},{OPTIONS}".encode()
        if libc.mount(b"hung", path.encode(), b"fuse", 0, data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount fuse on {path}: {os.strerror(err)}")
        try:
            yield path
        finally:
            os.close(fd)  # the connection ends: blocked calls fail, the mount can go
            fd = -1
            libc.umount2(path.encode(), MNT_DETACH)
    finally:
        if fd >= 0:
            os.close(fd)


@contextlib.contextmanager
def hung_mount_in(pid: int, path: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """The same mount on `path` in process `pid`'s mount namespace (a container's). The shell opens
    /dev/fuse on the host, nsenter's mount(8) passes that descriptor to the kernel, and the shell then
    holds it as `sleep` until this context ends."""
    script = (
        f"exec 3<>/dev/fuse && nsenter -t {pid} -m mount -i -t fuse -o fd=3,{OPTIONS} hung {path}"
        " && echo mounted && exec sleep 86400"
    )
    holder = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "mounted":
            holder.wait(timeout=30)
            raise OSError(f"could not mount a hung FUSE file system on {path} in pid {pid}'s namespace")
        yield path
    finally:
        holder.kill()  # its /dev/fuse closes: the connection ends
        holder.wait(timeout=30)
        # umount(8) stats the path first, which fails on the ended connection (ENOTCONN): the
        # system call itself, from the namespace's own python3 (every node has it for Ansible).
        detach = f"import ctypes; ctypes.CDLL(None).umount2({path!r}.encode(), {MNT_DETACH})"
        subprocess.run(["nsenter", "-t", str(pid), "-m", "python3", "-c", detach], check=False, timeout=60)
        mounts = subprocess.run(
            ["nsenter", "-t", str(pid), "-m", "cat", "/proc/self/mounts"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        if f" {path} fuse " in mounts:
            raise OSError(f"the hung FUSE mount on {path} in pid {pid}'s namespace is still there")
