"""Files written and read in a directory another account can write: no planted link is ever followed.

A run dir on the share is the training account's; root on a node or the operator (after copying a run
with its links) runs `trainer report` in it, and the trainer rewrites run.json there. Whoever can
write the directory can put a link under any name in it, so:

- write_file: the new content goes to a temporary name beside the target, created exclusively without
  following links (O_CREAT | O_EXCL | O_NOFOLLOW: a leftover or a planted link under that name is
  removed first and never opened; one planted again in between makes the write fail, never write
  through it), private until its mode is set, then renamed over the target (a rename replaces a link
  at the target, never writes through it). A reader sees the old file or the new one, never half.
- read_bytes / read_text: a regular file opened without following a link at its last component.

The node helper (trainer/controller/launcher/playbooks/files/node_ctl.py) runs with the standard library
alone and without this package on its path; it carries this write_file as its own, and
tests/unit/test_safe_files.py keeps the two identical.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def write_file(path: str | os.PathLike, data: str | bytes, mode: int = 0o644, tmp_name: str = "") -> None:
    """Write `path` whole, never through a link: `.NAME.tmp` (or `tmp_name`) beside it made exclusively,
    `mode` set before any byte, then renamed over `path`."""
    directory, name = os.path.split(os.fspath(path))
    tmp = os.path.join(directory, tmp_name or f".{name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a killed writer, or a planted link: removed, not opened
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "wb") as handle:
            os.fchmod(fd, mode)  # from 0600 to `mode`, whatever the umask
            handle.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def umask_mode(base: int = 0o666) -> int:
    """`base` less this process's umask: the mode a plain open() would have given. The trainer runs under
    umask 027 (a run's files are the training account's and its group's only), which write_file's
    explicit mode would otherwise override."""
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


def read_bytes(path: Path) -> bytes:
    """The bytes of the regular file `path`; OSError for a link (ELOOP) or anything not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return handle.read()


def read_text(path: Path) -> str:
    """read_bytes, decoded as UTF-8."""
    return read_bytes(path).decode("utf-8")
