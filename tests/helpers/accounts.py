"""A second local account for the hardening tests, made for real with `useradd` and removed after, and
a way to do one step as it (the attacker's step: plant a link, write a record) in a forked child."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

#: The start of every temporary account the tests make (here, and the two made by hand in
#: test_preflight_locks and test_preflight_iperf_local): a test that reads the machine's accounts while
#: other tests run beside it (CI's queue) leaves these out.
TEST_ACCOUNT_PREFIX = "ct-"


@contextlib.contextmanager
def local_account(name: str) -> Iterator[pwd.struct_passwd]:
    """The account `name`, made with useradd if it is not there (and then removed with userdel after).
    Skips the test without root or useradd."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to make a second account")
    made = False
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True
        )
        made = True
    try:
        yield pwd.getpwnam(name)
    finally:
        if made:
            subprocess.run(["userdel", name], check=False)


def as_account(account: pwd.struct_passwd, step: Callable[[], None]) -> None:
    """Run `step` in a child process as `account` (its uid and gid, no other group); raises when it
    failed there."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
            step()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the step as {account.pw_name} failed"


@contextlib.contextmanager
def open_dir(owner: pwd.struct_passwd | None = None) -> Iterator[Path]:
    """A directory under /tmp that every account may enter (pytest's tmp_path is root's only), owned by
    `owner` when given; removed after."""
    base = Path(tempfile.mkdtemp(prefix="ct-hardening-", dir="/tmp"))
    try:
        base.chmod(0o755)
        if owner is not None:
            os.chown(base, owner.pw_uid, owner.pw_gid)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def private_file(directory: Path, name: str, text: str) -> Path:
    """A file of this account (root) that no one else may read or write, in a dir of its own: what a
    planted link aims at."""
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / name
    path.write_text(text)
    path.chmod(0o600)
    return path
