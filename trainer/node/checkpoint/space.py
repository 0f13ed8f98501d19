"""Room on output_dir's file system for what a run writes.

Before each checkpoint rank 0 compares the free space with the size of the newest checkpoint (the next
one is the same size) and every rank stops together if it cannot fit; a write that still runs out of
space (the first checkpoint, or something else filling the disk) is recognised by its errno or by a
small probe write. Either way the run ends with `DiskFull` (exit NO_SPACE): one line naming the
directory, the bytes free and the checkpoint's size; `latest` still names the previous, intact
checkpoint, and the incomplete `.tmp-step-N` is removed when the run starts again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from trainer.node.checkpoint.layout import (
    TMP_PREFIX,
    UNIVERSAL_DIR,
    complete_checkpoints,
    latest_checkpoint,
    step_of,
)

#: errno values that mean "the file system (or this account's quota) is full".
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(Exception):
    """Output_dir's file system has no room for what the run must write (exit code NO_SPACE); the
    message is one line naming the directory, the bytes free and what did not fit. `everywhere`: every
    rank raised it together (rank 0 says it); else only the rank whose write failed knows."""

    def __init__(self, message: str, *, everywhere: bool = False):
        super().__init__(message)
        self.everywhere = everywhere


def human_size(size: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:,} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> int:
    """Bytes this process may still write on the file system holding path (root may use the blocks
    reserved for it, other accounts may not)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    info = os.statvfs(path)
    return (info.f_bfree if os.geteuid() == 0 else info.f_bavail) * info.f_frsize


def disk_usage(path: Path) -> int:
    """Bytes that the files under path occupy on disk (blocks, so a compressing file system counts
    what it really stores)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we counted
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def says_no_space(error: BaseException) -> bool:
    """Does `error` (or what caused it) say the file system or quota is full: an OSError's errno, or the
    OS's words in a library's own error (safetensors: "No space left on device (os error 28)")?"""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in NO_SPACE_ERRNOS:
            return True
        if any(os.strerror(number) in str(cause) for number in NO_SPACE_ERRNOS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def is_disk_full(error: BaseException, directory: Path) -> bool:
    """Did a write into directory fail because its file system (or quota) is full? says_no_space, else,
    for torch's C++ writer, whose RuntimeError has no errno ("iostream error"), a small probe write in
    directory decides. Only for errors of a write there: any error looks like this on a full disk."""
    if says_no_space(error):
        return True
    if not isinstance(error, OSError | RuntimeError):
        return False
    probe = Path(directory) / f"{TMP_PREFIX}space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 65536)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        return err.errno in NO_SPACE_ERRNOS
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return False


def no_space_message(
    directory: Path,
    *,
    step: int,
    needed: int,
    measured: bool,
    free: int,
    partial: bool = False,
) -> str:
    """The one line a full disk gets (see DiskFull). partial: `free` counts an incomplete write that the
    next start removes."""
    previous = latest_checkpoint(directory)
    need = (
        f"about {human_size(needed)} (the size of {previous.name if previous else 'the last checkpoint'})"
        if measured
        else f"more than {human_size(needed)} (written before the disk filled)"
    )
    kept = (
        f"{previous.name} is intact and stays `latest`"
        if previous
        else "there is no earlier checkpoint (the run starts from step 0 again)"
    )
    older = [p.name for p in complete_checkpoints(directory) if previous and p != previous]
    room = f"delete an older checkpoint ({', '.join(older)}), " if older else ""
    counted = " without the incomplete write (removed at the next start)" if partial else ""
    return (
        f"no space left on device for checkpoint step-{step} in {directory}: it needs {need}, "
        f"{human_size(free)} free{counted}; {kept}; free space there ({room}other files, or use "
        "another output_dir), then run the same command again to resume"
    )


def space_problem(
    directory: Path, *, step: int, save_total_limit: int, log: Callable[[str], None] | None = None
) -> str | None:
    """The no-space line if checkpoint `step` cannot fit, else None. Its size is the newest checkpoint's
    (the next one holds the same tensors); with no checkpoint yet it is not known: None.

    Room that can be made is no problem: the checkpoints save_total_limit deletes after this save anyway
    (never the one `latest` names); with `log` they are deleted now, before the write, and logged."""
    previous = latest_checkpoint(directory)
    if previous is None:
        return None
    needed = disk_usage(previous) - disk_usage(previous / UNIVERSAL_DIR)
    free = free_bytes(directory)
    if free >= needed:
        return None
    if save_total_limit > 0:
        ours = [p for p in complete_checkpoints(directory) if step_of(p) < step]
        # After this save the limit keeps save_total_limit: the oldest beyond that go (none while fewer).
        doomed = [p for p in ours[: max(0, len(ours) - (save_total_limit - 1))] if p != previous]
        if doomed and free + sum(disk_usage(p) for p in doomed) >= needed:
            if log is None:
                return None
            names = ", ".join(p.name for p in doomed)
            log(
                f"making room for step-{step} ({human_size(needed)}, {human_size(free)} free): removing "
                f"{names} now, which checkpoint.save_total_limit={save_total_limit} removes after it anyway"
            )
            for old in doomed:
                shutil.rmtree(old, ignore_errors=True)
            return None
    return no_space_message(directory, step=step, needed=needed, measured=True, free=free)
